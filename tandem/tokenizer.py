"""A checkpoint's tokenizer and chat template without transformers (and so without torch).

`transformers` builds a model's tokenizer (for a GGUF, from the file's metadata, which takes
seconds) and saves it as `tokenizer.json` + `tokenizer_config.json` under
`$TANDEM_HOME/tokenizers`, keyed by the checkpoint's name, size and mtime. That export runs once
per checkpoint, in a child process (`python -m tandem.engine.models.tokenizer_export CHECKPOINT
DEST`), because importing `transformers` imports torch. Everything after it reads the export:
`Tokenizer` here with the Rust `tokenizers` library and Jinja (the router), or `transformers`
(the engine).

`Tokenizer` renders chat templates the way `transformers` does (a sandboxed Jinja environment with
`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson` and `strftime_now`, the
special tokens as variables); tests/parity/test_tokenizer.py holds it to `transformers` on the
default model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.config import tandem_home
from tandem.model_config import is_gguf

# Run as a child process (it imports transformers, so torch): the router never imports it.
EXPORTER = "tandem.engine.models.tokenizer_export"
EXPORT_TIMEOUT_S = 600.0  # the child imports transformers and torch, then converts the vocabulary
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


def tokenizer_dir(path: str | Path) -> Path:
    """The checkpoint's tokenizer files: an HF directory itself when it has a `tokenizer.json`,
    else its export under `$TANDEM_HOME/tokenizers` (made now if missing)."""
    path = Path(path)
    if not is_gguf(path) and (path / "tokenizer.json").is_file():
        return path
    stat = path.stat()
    cached = tandem_home() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not cached.is_dir():
        subprocess.run(
            [sys.executable, "-m", EXPORTER, str(path), str(cached)],
            check=True,
            timeout=EXPORT_TIMEOUT_S,
        )
    return cached


class Tokenizer:
    """Encode, decode and render chat messages with a checkpoint's exported tokenizer."""

    def __init__(self, directory: Path) -> None:
        self.backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        settings = _read_json(directory / "tokenizer_config.json")
        self.special_tokens = {
            name: _token_text(settings[name]) for name in _SPECIAL_TOKENS if settings.get(name)
        }
        template_file = directory / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else settings.get("chat_template")
        )
        self._template: jinja2.Template | None = None
        self.max_token_chars = _max_token_chars(self.backend)  # None: a token's span is unbounded

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids. The batch call releases the GIL while it encodes: a long text
        encoded on another thread holds up none of this process's others."""
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def surely_longer(self, text: str, num_tokens: int) -> bool:
        """Whether `text` encodes to more than `num_tokens` tokens, told from its length alone
        (no token covers more than `max_token_chars` characters of the normalized text): a huge
        prompt is refused without the seconds its encoding would take."""
        if self.max_token_chars is None or len(text) <= num_tokens * self.max_token_chars:
            return False
        normalizer = self.backend.normalizer  # it may shorten the text (NFC composes characters)
        length = len(text) if normalizer is None else len(normalizer.normalize_str(text))
        return length > num_tokens * self.max_token_chars

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model was trained to read it; `tools` (function definitions,
        as transformers passes them) and `template_kwargs` are further variables of the
        template. `continue_final_message`: the text ends with the last message's content, which
        the model continues (its end-of-turn cut, as transformers does). ValueError if there is
        no chat template or it rejects the messages."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        variables = {**self.special_tokens, **template_kwargs}
        if tools is not None:
            variables["tools"] = list(tools)
        try:
            text = self._template.render(
                {
                    **variables,
                    "messages": list(messages),
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. None + str
            raise ValueError(str(e)) from None
        if not continue_final_message:
            return text
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or final.strip() not in text:
            raise ValueError("the final message's content is not in the rendered conversation")
        start = text.rindex(final.strip())
        # Keep the content's trailing spaces where the template kept them (it may trim them).
        kept = (
            len(final.lstrip()) if text[start:].startswith(final.lstrip()) else len(final.strip())
        )
        return text[: start + kept]

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template itself renders tool definitions and tool calls."""
        template = self.chat_template or ""
        return "tools" in template and "tool_calls" in template


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint (an HF directory or a .gguf file)."""
    return Tokenizer(tokenizer_dir(path))


def _max_token_chars(backend: tokenizers.Tokenizer) -> int | None:
    """The most characters of normalized text one token covers: its vocabulary's longest entry
    (a byte-level entry has one character per byte it covers; a byte-fallback entry such as
    `<0x0A>` more than the one it covers). None where a token can cover more, or characters can
    vanish: a model other than BPE (WordPiece's unknown word), BPE without byte-level
    pre-tokenization or byte fallback (it drops unknown characters, or fuses them into one
    token), a pre-tokenizer or normalizer that removes characters (Whitespace, a removing
    Split, Strip per special-token segment), an added token that swallows the spaces beside
    it (lstrip / rstrip)."""
    spec = json.loads(backend.to_str())
    model = spec["model"]
    steps = [*_steps(spec.get("pre_tokenizer")), *_steps(spec.get("normalizer"))]
    bytes_kept = model.get("byte_fallback") or any(s.get("type") == "ByteLevel" for s in steps)
    removes = any(
        s.get("type") in ("Whitespace", "WhitespaceSplit", "Strip")
        or (s.get("type") == "Split" and s.get("behavior") == "Removed")
        for s in steps
    )
    swallows = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
    if model.get("type") != "BPE" or not bytes_kept or removes or swallows:
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)


def _steps(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A pre-tokenizer's or normalizer's steps: itself, or those of its Sequence."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        key = "pretokenizers" if "pretokenizers" in component else "normalizers"
        return [step for part in component[key] for step in _steps(part)]
    return [component]


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _token_text(token: str | dict[str, Any]) -> str:
    return token if isinstance(token, str) else str(token["content"])  # an AddedToken as a dict


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
