"""One choice of a completion: engine events → text (stop strings cut, the final EOS hidden) and OpenAI logprobs.

Streaming takes the text in deltas; a delta holds back what could still change: the tail that may be the start of a
stop string, and a trailing U+FFFD (a multi-byte character whose remaining bytes are in the next token).
"""

from __future__ import annotations

from ssmq.runtime.engine import Event
from ssmq.runtime.protocol import Prompt


class Choice:
    def __init__(self, index: int, prompt: Prompt, tokenizer, stops: list[str], echo: bool, logprobs: int | None,
                 hide_token: int | None):
        self.index, self.tok, self.stops, self.logprobs = index, tokenizer, stops, logprobs
        self.hide_token = hide_token  # the EOS that ends a sequence is not text
        self.prompt_ids, self.echo = prompt.ids, echo
        self.echo_text = "" if not echo else (prompt.text if prompt.text is not None else tokenizer.decode(prompt.ids))
        self.tokens: list[int] = []  # generated, EOS included (usage counts it)
        self.stopped = False  # a stop string was found
        self.finish_reason: str | None = None
        self.error: Event | None = None
        self._sent = 0  # characters of the visible text already taken
        self._echo_pending = echo
        self._lp_sent = 0
        self._text_at: tuple[int, str] = (-1, "")  # (len(tokens), _text()) of the last decode
        self.lp = None
        if logprobs is not None:
            self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            self._offset = 0
            if echo:
                self._add_lp(prompt.ids[0], None, None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _add_lp(self, token: int, logprob: float | None, top: list | None) -> None:
        piece = self.tok.decode([token])
        self.lp["tokens"].append(piece)
        self.lp["token_logprobs"].append(logprob)
        if top is None:
            self.lp["top_logprobs"].append(None)
        else:  # the top ``logprobs`` alternatives, and the chosen token (as vLLM)
            entries = {self.tok.decode([i]): v for i, v in top[:self.logprobs]}
            entries.setdefault(piece, logprob)
            self.lp["top_logprobs"].append(entries)
        self.lp["text_offset"].append(self._offset)
        self._offset += len(piece)

    def on_event(self, ev: Event) -> None:
        if ev.kind == "prompt":
            if self.lp is not None and self.echo:
                k = len(self.lp["tokens"])
                for j, (logprob, top) in enumerate(ev.prompt):
                    self._add_lp(self.prompt_ids[k + j], logprob, top)
        elif ev.kind == "token":
            self.tokens.append(ev.token)
            if self.lp is not None and not self.stopped and ev.token != self.hide_token:
                self._add_lp(ev.token, ev.logprob, ev.top)
            self._check_stop()
        elif ev.kind == "done":
            self.finish_reason = "stop" if self.stopped else ev.reason
        elif ev.kind == "error":
            self.error = ev

    def _text(self) -> str:
        # kept per token count: a streamed token with stop strings asks twice (stop check, then take), and the
        # decode is of the whole sequence (exact for any tokenizer, but O(length))
        if self._text_at[0] == len(self.tokens):
            return self._text_at[1]
        ids = self.tokens[:-1] if self.tokens and self.tokens[-1] == self.hide_token else self.tokens
        text = self.tok.decode(ids)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            text = text[:min(cuts)]
        self._text_at = (len(self.tokens), text)
        return text

    def _check_stop(self) -> None:
        if self.stops and not self.stopped:
            self._text()

    def take(self) -> tuple[str, dict | None]:
        """(new text, new logprobs entries) since the last take; everything once finished or stopped."""
        text = self._text()
        end = len(text)
        if not (self.finished or self.stopped):
            end -= max((len(s) for s in self.stops), default=1) - 1
            while end > self._sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        if self._echo_pending:
            delta, self._echo_pending = self.echo_text + delta, False
        lp = None
        if self.lp is not None:
            lp = {k: v[self._lp_sent:] for k, v in self.lp.items()}
            self._lp_sent = len(self.lp["tokens"])
        return delta, lp

    def body(self) -> dict:
        """The whole choice (non-streaming)."""
        return {"index": self.index, "text": self.echo_text + self._text(), "logprobs": self.lp,
                "finish_reason": self.finish_reason}
