"""Chat prompts: a model's chat template (Jinja, as Hugging Face tokenizer files store it) rendered for a list of
messages, in the sandboxed environment transformers renders it in (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``tojson``, ``strftime_now``).

Where a template comes from: ``--chat-template FILE``, else the model folder's ``chat_template.jinja``, else its
``tokenizer_config.json`` ``chat_template`` (a string, or a list of named templates: "default"), else a GGUF file's
``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ssmq.errors import SSMQError


class ChatTemplateError(SSMQError):
    """The template refused the messages (its ``raise_exception``) or failed while rendering them."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older tokenizer_config.json files
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise SSMQError("chat templates need jinja2: pip install -e \".[serve]\"") from None

        def raise_exception(message):
            raise ChatTemplateError(str(message))

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise SSMQError(f"the chat template does not parse: {e}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role", "content"(, "name")}] → the prompt text (special tokens as text)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except Exception as e:  # the template's own error on these messages (a missing key, a bad operation)
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def _from_config(folder: Path) -> tuple[str | None, str, str]:
    """(template, bos_token, eos_token) from a model folder's tokenizer files."""
    template, bos, eos = None, "", ""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        bos, eos = _token_text(data.get("bos_token")), _token_text(data.get("eos_token"))
        template = data.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    return (template if isinstance(template, str) else None), bos, eos


def _from_gguf(path: Path) -> tuple[str | None, str, str]:
    try:
        from gguf import GGUFReader
    except ImportError:
        return None, "", ""
    reader = GGUFReader(str(path))
    field = reader.fields.get("tokenizer.chat_template")
    return (field.contents() if field is not None else None), "", ""


def load_chat_template(model_path, template_file=None) -> ChatTemplate | None:
    """The chat template for a model (folder or .gguf file), ``template_file`` first; None when there is none."""
    found, bos, eos = None, "", ""
    if model_path is not None:
        p = Path(str(model_path))
        if p.is_dir():
            found, bos, eos = _from_config(p)
        elif p.is_file() and p.suffix == ".gguf":
            found, bos, eos = _from_gguf(p)
    if template_file is not None:
        f = Path(template_file)
        if not f.is_file():
            raise SSMQError(f"--chat-template: no file {template_file}")
        found = f.read_text()
    return None if found is None else ChatTemplate(found, bos, eos)
