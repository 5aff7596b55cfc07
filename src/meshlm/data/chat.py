"""Chat conversations to tokens and a loss mask, with the tokenizer's own chat template.

A template is rendered with ``jinja2`` directly, in the environment transformers' ``apply_chat_template``
builds (a sandbox, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, its
``tojson`` and ``strftime_now``, and the ``{% generation %}`` block that marks assistant text), with the
tokenizer's special tokens as variables (``bos_token``, ``eos_token``, ...), and the text tokenized
without added special tokens: the ids ``apply_chat_template(messages, tokenize=True)`` gives, without
transformers at run time (jinja2 is a runtime dependency; transformers is a test dependency only).

The assistant spans: a template with ``{% generation %}`` blocks says where they are (their characters,
mapped to the tokens that overlap them, as ``return_assistant_tokens_mask``). A template without them
(most stock templates) is rendered on prefixes: assistant turn i is the text the conversation adds
between ``messages[:i]`` with the generation prompt and ``messages[:i + 1]`` -- what a model must
generate after the prompt, its end-of-turn included. Where a prefix does not render as the start of the
whole conversation (a template that rewrites earlier turns), the spans cannot be found: one clear
error, never a mask of all ones (Megatron-Bridge #3359).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from meshlm.data.hf_tokenizer import HFTokenizer
from meshlm.data.record_check import what
from meshlm.data.tokenizer_files import chat_template_of, tokenizer_config
from meshlm.errors import DataError

TRAIN_ON = ("assistant", "all", "last")  # which tokens a conversation trains on (``--train-on``)
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
GEN, END = "\x00gen\x00", "\x00end\x00"  # around a generation block's output while rendering
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _special(value) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def template_source(tok, override: str | Path | None = None) -> tuple[str, dict]:
    """(the chat template text, the special tokens it sees) of a tokenizer and the files it comes with
    (``tok.files``: read by ``data.tokenizer_files``, so a checkpoint's are checked against the SHA-256
    its meta records): ``override`` (a .jinja file), else its own (``tokenizer_files.chat_template_of``)."""
    config = tokenizer_config(tok)
    specials = {k: v for k in SPECIAL_NAMES if (v := _special(config.get(k))) is not None}
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"--chat-template {override}: no such file; pass a Jinja chat template file")
        return path.read_text(encoding="utf-8"), specials
    template = chat_template_of(tok.files)
    if template is None:
        raise DataError(
            f"the {getattr(tok, 'source', 'tokenizer')} has no chat template (no chat_template.jinja, no "
            "chat_template in tokenizer_config.json); pass one with --chat-template FILE"
        )
    return template, specials


class ChatTemplate:
    """A compiled chat template and the tokenizer it renders for."""

    def __init__(self, text: str, tokenizer: HFTokenizer, specials: dict | None = None):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: the block's output, its characters recorded."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                call = self.call_method("_mark")
                return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                return GEN + caller() + END  # markers ``render`` turns into character spans

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            kw = dict(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
            return json.dumps(x, **kw)  # transformers' own: no HTML escaping

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(
                f"the chat template does not compile ({e}); fix it or pass --chat-template FILE"
            ) from None
        self.text, self.tok, self.specials = text, tokenizer, dict(specials or {})
        self.has_generation = bool(GENERATION.search(text))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list]:
        """(the rendered text, the character spans of its generation blocks)."""
        import jinja2

        try:
            out = self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
            )
        except jinja2.exceptions.TemplateError as e:  # the template's raise_exception, or its syntax
            raise DataError(f"the chat template refused the conversation: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # in its expressions
            raise DataError(
                f"the chat template failed on the conversation ({type(e).__name__}: {e}); check its "
                "messages against what the template expects"
            ) from None
        text, spans, pos = [], [], 0
        for part in re.split(f"({GEN}|{END})", out):
            if part == GEN:
                spans.append([pos, None])
            elif part == END:
                spans[-1][1] = pos
            else:
                text.append(part)
                pos += len(part)
        return "".join(text), [tuple(s) for s in spans]

    def prefix_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """The assistant turns' character spans found by rendering prefixes (see the module doc)."""
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prompt, _ = self.render(messages[:i], add_generation_prompt=True)
            turn, _ = self.render(messages[: i + 1])
            if not (turn.startswith(prompt) and full.startswith(turn)) or len(turn) == len(prompt):
                raise DataError(
                    f"the chat template renders the conversation up to assistant turn {i} differently from "
                    "the start of the whole conversation, so its assistant spans cannot be found; pass "
                    "--chat-template FILE with {% generation %} ... {% endgeneration %} around assistant "
                    "turns, or --train-on all"
                )
            spans.append((len(prompt), len(turn)))
        return spans

    def encode(
        self, messages: list[dict], train_on: str = "assistant", where: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [n], loss mask uint8 [n]) of one conversation: 1 on the tokens it trains on. An
        error names ``where`` (the record's FILE:LINE) when given."""
        if train_on not in TRAIN_ON:
            raise DataError(f"--train-on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        try:
            return self._encode(messages, train_on)
        except DataError as e:
            raise DataError(f"{where}: {e}" if where else str(e)) from None

    def _encode(self, messages: list[dict], train_on: str) -> tuple[np.ndarray, np.ndarray]:
        full, marked = self.render(messages)
        enc = self.tok.tok.encode(full, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        if train_on == "all":
            return ids, np.ones(len(ids), np.uint8)
        spans = marked if self.has_generation else self.prefix_spans(messages, full)
        if not spans:
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise DataError(
                f"a conversation with no assistant turn to train on (its roles: {roles}); leave it out "
                "or use --train-on all"
            )
        spans = spans[-1:] if train_on == "last" else spans
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)  # [n, 2] characters of each token
        mask = np.zeros(len(ids), np.uint8)
        for start, end in spans:  # a token overlapping a span trains (transformers' char_to_token)
            mask |= ((offsets[:, 0] < end) & (offsets[:, 1] > start)).astype(np.uint8)
        return ids, mask


def conversation(row, where: str, train_on: str | None = None) -> list[dict]:
    """A record's messages (``conversation_problem``); a bad record is one error naming ``where``."""
    messages, problem = conversation_problem(row, train_on)
    if problem is not None:
        raise DataError(f"{where}: {problem}")
    return messages


def conversation_problem(row, train_on: str | None = None) -> tuple[list[dict] | None, str | None]:
    """(messages, None) of a record -- ``messages`` [{role, content}], or a prompt/completion pair
    (strings, or lists of messages as trl's conversational form) -- each content a string (text-only
    content parts joined: ``text_of``); else (None, what is wrong). With ``train_on`` other than
    "all", a conversation without an assistant turn is wrong too (its roles named)."""
    if not isinstance(row, dict):
        return None, f"is {what(row)}, not an object; {SHAPE}"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list):
            return None, f"its `messages` is {what(messages)}, not a list of messages; {SHAPE}"
        if not messages:  # its own reason, under every --train-on ("all" would train on nothing)
            return None, "its `messages` is empty: no message to train on; give it its turns or leave it out"
    elif "prompt" in row and "completion" in row:
        parts = []
        for key, role in (("prompt", "user"), ("completion", "assistant")):
            value = row[key]
            if not isinstance(value, str | list):
                return None, f"its `{key}` is {what(value)}, not a string or a list of messages; {SHAPE}"
            parts += [{"role": role, "content": value}] if isinstance(value, str) else value
        messages = parts
    else:
        fields = ", ".join(map(str, row)) or "none"
        return None, f"is not a conversation (its fields: {fields}); {SHAPE}"
    out = []
    for i, m in enumerate(messages):
        message, problem = _message(m, i)
        if problem is not None:
            return None, problem
        out.append(message)
    roles = [m["role"] for m in out]
    if train_on not in (None, "all") and "assistant" not in roles:
        return None, (
            f"a conversation with no assistant turn to train on (its roles: {', '.join(roles)}); "
            "leave it out or use --train-on all"
        )
    return out, None


SHAPE = (
    "give each record `messages` (a list of {role, content} with string values) or `prompt` and `completion`"
)


def _message(m, i: int) -> tuple[dict | None, str | None]:
    """(message with a string content, None), or (None, what is wrong with message ``i``)."""
    if not isinstance(m, dict):
        return None, f"message {i} is {what(m)}, not an object with `role` and `content`; {SHAPE}"
    missing = [k for k in ("role", "content") if k not in m]
    if missing:
        return None, f"message {i} has no `{missing[0]}` (its fields: {', '.join(map(str, m))}); {SHAPE}"
    if not isinstance(m["role"], str) or not m["role"]:
        return None, f'message {i}\'s role is {what(m["role"])}, not a role name such as "user"; {SHAPE}'
    content, problem = text_of(m["content"])
    if problem is not None:
        return None, f"message {i} ({m['role']}): {problem}"
    return {**m, "content": content}, None


def text_of(content) -> tuple[str | None, str | None]:
    """A message's content as text: a string as it is; OpenAI-style content parts that are all text
    ([{"type": "text", "text": ...}]) joined with newlines (vLLM's "string" content format), so that
    every template sees the string it renders for a plain message; else (None, what is wrong)."""
    if isinstance(content, str):
        return content, None
    fix = 'give a string, or a list of {"type": "text", "text": STRING} parts'
    if not isinstance(content, list) or not content:
        return None, f"content is {what(content)}; {fix}"
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            found = f"of type {kind!r}" if kind is not None else what(part)
            why = " (only text is trained on)" if isinstance(kind, str) and kind != "text" else ""
            return None, f"content part {j} is {found}{why}; {fix}"
        texts.append(part["text"])
    return "\n".join(texts), None
