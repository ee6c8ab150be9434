"""``ssmq export``: write an ssmq quantized checkpoint in another runtime's format (compressed-tensors)."""

from __future__ import annotations

FORMATS = ("compressed-tensors",)


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a quantized checkpoint as a compressed-tensors HF folder "
                              "(vLLM, transformers)")
    p.add_argument("--model", required=True, help="an ssmq quantized checkpoint folder (output of `ssmq quantize`)")
    p.add_argument("--format", required=True, choices=FORMATS, help="the format written")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (atomically)")
    p.set_defaults(func=run)


def run(args) -> None:
    from ssmq.quant.compressed_tensors import export_compressed_tensors

    out = export_compressed_tensors(args.model, args.out, overwrite=args.overwrite)
    print(f"exported {args.model} -> {out} ({args.format})")
