"""SSDi8 (after the SSDi8 paper, ICLR 2026): a persistent int8 path inside the Mamba-2 SSD, and mean correction.

Glossary: as ``ssmq.ops.ssd_int8`` (b, l, h, p, g, n, c chunks, T); L layers; η mean-correction strength.

    SSDi8Scan         replaces a Mamba-2 mixer's ``ssd`` (``models.mamba2.ChunkScan``): quantizes B and C once
                      (one scale per group), runs ``kernels.ssd_int8`` (Triton integer stages on CUDA, the exact
                      reference ``ops.ssd_int8.ssd_int8_ref`` elsewhere) with static scales, and gives the
                      cache its final state dequantized from the int8 codes (so the int8 state cache stores the
                      very codes the prefill computed: decode reads the int8 state the prefill wrote)
    install_ssdi8_    swap every Mamba-2 scan for an observing SSDi8Scan, calibrate, set the static scales
    gamma_migration_  fold each Mamba layer's RMSNorm γ into its in_proj (the norm output then has no γ outliers)
    mean_correction_  per layer, in order: bias_i = η · mean_tokens(Y_i − Y'_i) added to out_proj's output, where
                      Y is the float model's out_proj output and Y' the quantized model's with the corrections of
                      layers < i already applied (corrected activations propagate)
    enable_ssdi8_state  the int8 state cache of each Mamba-2 layer takes the scan's state scale per (h, p)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.ops.quant_ssm import dequantize_ref, quantize_ref
from ssmq import kernels
from ssmq.ops.ssd_int8 import SSDi8Options, ssd_int8_ranges
from ssmq.quant.calibration import CalibrationData, run_calibration
from ssmq.quant.rotation import fold_norm_
from ssmq.quant.ssm.transforms import ssm_layers

SCALES = ("B_scale", "C_scale", "x_scale", "xs_scale", "state_scale")


class SSDi8Scan(nn.Module):
    """The int8 SSD of one Mamba-2 layer; call signature of ``kernels.ssd_chunk_scan``.

    Buffers (float32): B_scale, C_scale (g,); x_scale, xs_scale, state_scale (h, p). ``observing``: run the float
    scan and record the ranges the scales are set from (calibration).
    """

    takes_state_rows = False  # its int8 state goes through the cache's read_ssm / write_ssm

    def __init__(self, nheads: int, headdim: int, ngroups: int, options: SSDi8Options = SSDi8Options()):
        super().__init__()
        self.nheads, self.headdim, self.ngroups, self.options = nheads, headdim, ngroups, options
        for name in SCALES:
            self.register_buffer(name, torch.ones(ngroups if name[0] in "BC" else (nheads, headdim)))
        self.observing = False
        self.ranges: dict[str, torch.Tensor] = {}

    def forward(self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False):
        if self.observing:
            return self._observe(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                                 return_final_states)
        sB, sC, s_state = self.B_scale[:, None], self.C_scale[:, None], self.state_scale[..., None]
        B_q, C_q = quantize_ref(B.float(), sB), quantize_ref(C.float(), sC)  # early B/C quantization, once
        init = initial_states
        if init is not None and self.options.int8_state:
            init = init if init.dtype == torch.int8 else quantize_ref(init.float(), s_state)
        out = kernels.ssd_int8(x, dt, A, B_q, self.B_scale, C_q, self.C_scale, self.xs_scale, self.state_scale,
                           chunk_size, D, z, dt_bias, dt_softplus, dt_limit, init, return_final_states,
                           self.x_scale, self.options)
        y, final = out if return_final_states else (out, None)
        y = y.to(x.dtype)
        if not return_final_states:
            return y
        return y, dequantize_ref(final, s_state) if self.options.int8_state else final

    def _observe(self, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                 return_final_states):
        r = ssd_int8_ranges(x, dt, A, B, C, chunk_size, dt_bias, dt_softplus, dt_limit, initial_states)
        for k, v in r.items():
            v = v.to(self.state_scale.device)
            self.ranges[k] = v if k not in self.ranges else torch.maximum(self.ranges[k], v)
        return kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit,
                                      initial_states, return_final_states)

    @torch.no_grad()
    def set_scales_from_ranges(self) -> None:
        for k in ("B", "C", "x", "xs", "state"):
            getattr(self, f"{k}_scale").copy_((self.ranges[k].float() / 127.0).clamp(min=1e-8))
        self.ranges, self.observing = {}, False

    def spec(self) -> dict:
        return {"kind": "SSDi8Scan", "nheads": self.nheads, "headdim": self.headdim, "ngroups": self.ngroups,
                "options": self.options.to_dict()}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, device=None) -> "SSDi8Scan":
        return cls(spec["nheads"], spec["headdim"], spec["ngroups"], SSDi8Options(**spec["options"]))

    def extra_repr(self) -> str:
        return f"h={self.nheads}, p={self.headdim}, g={self.ngroups}, {self.options}"


def mamba2_layers(model: nn.Module) -> list[int]:
    return [i for i in ssm_layers(model) if model.config.layer_kind(i) == "mamba2"]


@torch.no_grad()
def install_ssdi8_(model: nn.Module, calib: CalibrationData, options: SSDi8Options = SSDi8Options(),
                   **kw) -> dict[int, SSDi8Scan]:
    """Swap each Mamba-2 layer's scan for an SSDi8Scan with static scales calibrated on ``calib``."""
    cfg = model.config
    dev = next(model.parameters()).device
    scans = {}
    for i in mamba2_layers(model):
        scan = SSDi8Scan(cfg.nheads, cfg.headdim, cfg.ngroups, options).to(dev)
        scan.observing = True
        model.layers[i].mixer.ssd = scan
        scans[i] = scan
    run_calibration(model, calib, desc="SSDi8 scales", **kw)
    for scan in scans.values():
        scan.set_scales_from_ranges()
    return scans


@torch.no_grad()
def gamma_migration_(model: nn.Module) -> None:
    """RMSNorm γ of every Mamba layer folded into its in_proj (W <- W diag(γ), γ <- 1): function unchanged."""
    for i in ssm_layers(model):
        fold_norm_(model.layers[i].norm, [model.layers[i].mixer.in_proj])


class _Stop(Exception):
    pass


@torch.no_grad()
def out_proj_means(model: nn.Module, layers: list[int], calib: CalibrationData, batch_size: int = 8,
                   stop_after: int | None = None) -> dict[int, torch.Tensor]:
    """{layer: (d_model,) mean over calibration tokens of its mixer's out_proj output}; the forward stops after
    layer ``stop_after`` (the later layers cannot change it)."""
    sums: dict[int, torch.Tensor] = {}
    count = [0]

    def hook(i):
        def fn(module, inputs, output):
            o = output.float().reshape(-1, output.shape[-1])
            sums[i] = o.sum(0) + sums.get(i, 0)
            if i == layers[0]:
                count[0] += o.shape[0]
            if i == stop_after:
                raise _Stop
        return fn

    handles = [model.layers[i].mixer.out_proj.register_forward_hook(hook(i)) for i in layers]
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for s in range(0, calib.input_ids.shape[0], batch_size):
            try:
                model(calib.input_ids[s:s + batch_size].to(dev))
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {i: v / count[0] for i, v in sums.items()}


@torch.no_grad()
def add_out_proj_bias_(mixer: nn.Module, bias: torch.Tensor) -> None:
    lin = mixer.out_proj
    if lin.bias is None:
        lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype if hasattr(lin, "weight")
                                            and lin.weight.is_floating_point() else torch.float32,
                                            device=bias.device), requires_grad=False)
    lin.bias.add_(bias.to(lin.bias.dtype))


@torch.no_grad()
def mean_correction_(model: nn.Module, reference: nn.Module, calib: CalibrationData, eta: float = 0.15,
                     batch_size: int = 8, progress: bool = False) -> dict[int, torch.Tensor]:
    """Per Mamba layer in order, out_proj's bias += η · (mean Y − mean Y'); returns {layer: bias added}.

    reference: the float model after the same function-preserving transforms (same residual basis).
    """
    from tqdm.auto import tqdm

    layers = ssm_layers(model)
    if not layers or eta == 0:
        return {}
    want = out_proj_means(reference, layers, calib, batch_size)
    added = {}
    for i in tqdm(layers, desc="mean correction", disable=not progress, unit="layer"):
        got = out_proj_means(model, [i], calib, batch_size, stop_after=i)[i]
        added[i] = eta * (want[i].to(got.device) - got)
        add_out_proj_bias_(model.layers[i].mixer, added[i])
    return added


@torch.no_grad()
def enable_ssdi8_state(model: nn.Module) -> None:
    """Int8 SSM state cache whose scales are each SSDi8 scan's state scale per (h, p) (the same for every n)."""
    from ssmq.quant.ssm.state_cache import to_int8_state

    cfg = model.config
    d, n = cfg.d_inner, cfg.d_state
    for i in mamba2_layers(model):
        scan = model.layers[i].mixer.ssd
        mixer = to_int8_state(model.layers[i].mixer, cfg, torch.arange(d), d)
        mixer.state_scale.copy_(scan.state_scale.reshape(d, 1).expand(d, n))
        model.layers[i].mixer = mixer
