"""Chat rows -> token ids and per-token loss weights, with palingenesis's SFT masking.

One row (a mapping) holds a conversation. :func:`encode` renders it with the model's own chat
template (``tokenizer.apply_chat_template``), tokenizes the render and marks which tokens are
trained, by the rules of palingenesis's (pgs) ``ChatDataset``:

- **Messages** come from ``opts.messages_field``, else the first non-empty of ``conversations``,
  ``conversation``, ``chat``, ``dialogue``, ``turns`` (a list, or a JSON string of one). Each
  message is normalised as pgs's ``normalize_messages`` does: the role is read from ``role``,
  ``from``, ``sender``, ``author`` or ``type`` and mapped (``human`` -> user, ``gpt`` ->
  assistant, ``function`` -> tool, ...), the content from ``content``, ``value``, ``text``,
  ``message`` or ``response``; ``reasoning``/``think`` become ``reasoning_content`` and a legacy
  ``function_call`` becomes ``tool_calls``. Other keys (``tool_call_id``, ``name``, ...) are kept.
- **Tools** (``row[opts.tools_field]``, a list or a JSON string of one) go to the template as
  ``tools=``; ``opts.chat_template_kwargs`` (per file), overridden key by key by the row's own
  ``chat_template_kwargs``, go to it as extra variables (e.g. ``enable_thinking``, ``date_string``).
- **Masking** is one template-agnostic path: the conversation is rendered once as text,
  tokenized with character offsets (``add_special_tokens=False``: the template writes BOS itself),
  and each message's reasoning and answer are found in the render by a cursor that only moves
  forward, so templates that rewrite history (Qwen3 drops ``<think>`` from past turns) are
  handled like any other. A message's reasoning is its ``reasoning_content``, else the text of a
  ``<think>...</think>`` block in its content; its answer is the rest of the content. A content
  given as a list of parts (``[{"type": "text", "text": ...}, ...]``) is located by its text
  parts, each stripped, in order (its reasoning can then only come from ``reasoning_content``);
  its answer is those parts and the whitespace between two of them, not what else lies between
  (an image token). A token is trained when it overlaps trained text. For each trained message:

  - assistant: the answer; with ``train_on_reasoning`` also everything from the ``<think>``
    opener through the reasoning up to the answer;
  - terminator: after the trained text (the answer; for a turn without one, the reasoning when
    it is trained) the whitespace tokens, then one special token (the end of turn, e.g.
    ``<|eot_id|>``, ``<|im_end|>``: a named or extra special token of the tokenizer, or an added
    token flagged special) and one whitespace token after it. Other text a template adds after
    the content is not trained, as in pgs, except a tool call:
  - tool call (an assistant message with ``tool_calls``): what the template renders for the turn
    after the located answer (for a turn without one: after the located reasoning, else after the
    assistant header) through the turn's end token, plus one whitespace token after that. The
    header's end is the end of the render of the messages before it with
    ``add_generation_prompt=True``, used only when that render is a prefix of the full one. The
    end token is the first special token from there on that, past whitespace tokens, another
    special token or the end of the render follows (``<|eot_id|>``, ``<|eom_id|>``, ``</s>``;
    not ``<|python_tag|>`` or ``[CALL_ID]``, which text follows). Without ``train_on_reasoning``
    a ``</think>`` closer (or a whole ``<think>...</think>`` block) and the whitespace after it at
    the start of that region are left out. Nothing is trained for the call when the region holds
    nothing else, or when its start cannot be found (no answer or reasoning located, and a
    template whose history rewriting makes the prefix render differ, or that cannot render it):
    then the turn is masked as pgs masks it. The cursor moves past the end token. The call's
    tokens belong to its assistant message (``last_turn_only``, turn weights). pgs's offset
    masker, which this otherwise follows, never trains a call; HF's ``{% generation %}`` spans
    (used by pgs for templates that have them) do;
  - ``include_observations``: tool / observation / ipython messages are trained the
    same way (never affected by ``last_turn_only``), and so is the text between the tool-output
    markers pgs knows (``<tool_response>``...``</tool_response>`` and the others in
    ``ECHO_MARKERS``) anywhere in the render;
  - ``last_turn_only``: of the assistant messages only the last is trained.

- **Weights**: ``uniform`` gives every trained token 1. With n > 1 assistant messages (counted
  whether trained or not), ``progressive`` gives the tokens of assistant message j
  ``sqrt((j+1)/n)`` and ``last_heavy`` gives the last one 2 and the others 1; observation tokens
  get 1. All are then divided by their mean, so the nonzero weights have mean 1.
- **max_seq_length**, what is dropped and what is cut: a render of at most ``max_seq_length``
  tokens is kept whole. A longer conversation loses whole messages from its end: the prefixes
  ``messages[:1]``, ``messages[:2]``, ... are rendered in turn and it keeps the last one before
  the first whose render is too long (a prefix the template cannot render is passed over; the kept
  prefix may end on a user message, as in pgs). It must hold an assistant message, else the row
  is skipped. This step never cuts inside a message. Tokens are cut (the ids past
  ``max_seq_length`` and their weights dropped, then the weights renormalised) only when the
  kept prefix's render is still too long, which takes a template that renders the same messages
  differently on a second call (one printing the current time). pgs skipped the first step, and
  cut tokens instead, for rows with fewer than 3 content characters per allowed token; here the
  token count decides.

Rows pgs skips raise :class:`SkipRow` (the caller counts them); malformed rows raise
:class:`BadRow`; a tokenizer or template that cannot be used raises :class:`BadTemplate`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable, Mapping

import numpy as np

MESSAGE_FIELDS = ("conversations", "conversation", "chat", "dialogue", "turns")
ROLE_KEYS = ("role", "from", "sender", "author", "type")
CONTENT_KEYS = ("content", "value", "text", "message", "response")
ROLES = {"human": "user", "instruction": "user", "input": "user",
         "gpt": "assistant", "bot": "assistant", "ai": "assistant", "model": "assistant",
         "chatbot": "assistant", "output": "assistant", "response": "assistant",
         "function": "tool"}
OBSERVATION_ROLES = frozenset({"tool", "observation", "ipython"})      # "function" reads as tool
# Tool-output markers whose enclosed text is an observation wherever the template puts it.
ECHO_MARKERS = (("<tool_response>", "</tool_response>"),
                ("<|tool▁output|>", "<|tool▁output▁end|>"),
                ("<observation>", "</observation>"), ("[Tool Output]", "[/Tool Output]"),
                ("```output\n", "```"))
TURN_SCALINGS = ("uniform", "progressive", "last_heavy")
# Arguments encode() sets itself; a template variable of the same name would clash with them.
RESERVED_KWARGS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict",
                             "return_assistant_tokens_mask"})
# A think block (or a bare closer) at the start of a tool call's region: reasoning, not the call.
THINK_BLOCK = re.compile(r"\s*(?:<think>.*?)?</think>\s*", re.DOTALL)
PROBE = ("Probe question about the weather?", "Probe answer: sunny.")


class SkipRow(Exception):
    """A row pgs skips; ``reason`` is a short fixed category for the caller's counts."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BadRow(ValueError):
    """A row that is malformed for the data or the template."""


class BadTemplate(ValueError):
    """A tokenizer or chat template that cannot produce masked SFT samples."""


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    max_seq_length: int
    messages_field: str = "messages"
    tools_field: str = "tools"
    include_observations: bool = False
    train_on_reasoning: bool = True
    last_turn_only: bool = False
    turn_scaling: str = "uniform"          # uniform | progressive | last_heavy
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.max_seq_length < 1:
            raise ValueError(f"max_seq_length must be positive, got {self.max_seq_length}")
        if self.turn_scaling not in TURN_SCALINGS:
            raise ValueError(f"turn_scaling must be one of {TURN_SCALINGS}, "
                             f"got {self.turn_scaling!r}")
        if self.chat_template_kwargs is None:
            object.__setattr__(self, "chat_template_kwargs", {})
        if not isinstance(self.chat_template_kwargs, Mapping):
            raise ValueError("chat_template_kwargs must be a mapping, got "
                             f"{type(self.chat_template_kwargs).__name__}")
        clash = RESERVED_KWARGS & set(self.chat_template_kwargs)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}: "
                             "encode() sets them")


@dataclasses.dataclass(frozen=True)
class Encoded:
    ids: np.ndarray      # int32 [n], n <= max_seq_length: the rendered conversation's tokens
    weights: np.ndarray  # float32 [n]: loss weight of ids[i] as a target; nonzero ones have mean 1


def check_template(tokenizer, opts: ChatOptions) -> None:
    """Raise BadTemplate unless the tokenizer is fast, has a chat template, and renders a probe
    user/assistant exchange with the answer verbatim after some assistant marker."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadTemplate("the tokenizer has no chat template: SFT rows are rendered with it; use "
                          "the chat/instruct model's tokenizer or set tokenizer.chat_template")
    _require_fast(tokenizer)
    question, answer = PROBE
    probe = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    try:
        text = _render(tokenizer, probe, None, dict(opts.chat_template_kwargs))
    except Exception as err:  # noqa: BLE001 - any template failure is reported as such
        raise BadTemplate(f"the chat template cannot render a user/assistant exchange "
                          f"({type(err).__name__}: {err}); fix the template or its "
                          f"chat_template_kwargs") from err
    q = text.find(question)
    a = text.find(answer, q + len(question)) if q >= 0 else -1
    if a < 0:
        raise BadTemplate("the chat template does not render message contents verbatim, so the "
                          f"assistant text cannot be located for masking (probe render: {text!r})")
    if not text[q + len(question):a].strip():
        raise BadTemplate("the chat template has no assistant marker: nothing but whitespace "
                          "separates the user text from the assistant text, so the answer's start "
                          f"cannot be told from the prompt (probe render: {text!r}); use a chat "
                          "template with role headers")


def encode(row: Mapping, tokenizer, opts: ChatOptions) -> Encoded:
    """Render, mask, truncate and weight one chat row; raises SkipRow or BadRow (BadTemplate for
    a slow tokenizer)."""
    _require_fast(tokenizer)
    messages = _messages(row, opts)
    tools = _tools(row, opts)
    kwargs = _template_kwargs(row, opts)
    text = _render_row(tokenizer, messages, tools, kwargs)
    enc = _tokenize(tokenizer, text)
    if len(enc["input_ids"]) > opts.max_seq_length:
        messages = _fit(tokenizer, messages, tools, kwargs, opts.max_seq_length)
        text = _render_row(tokenizer, messages, tools, kwargs)
        enc = _tokenize(tokenizer, text)
    ids = np.asarray(enc["input_ids"], np.int32)
    weights = _weights(text, enc["offset_mapping"], ids, messages, _special_ids(tokenizer), opts,
                       _header_finder(tokenizer, messages, tools, kwargs, text))
    ids, weights = ids[:opts.max_seq_length], weights[:opts.max_seq_length]
    trained = weights > 0
    if not trained.any():
        raise SkipRow("no trained tokens")
    weights[trained] /= weights[trained].mean()
    return Encoded(ids=ids, weights=weights)


def as_messages(value, role: str) -> list:
    """A cell that holds messages, one message (a mapping), or a string: one message of
    ``role``; None or a blank string is no message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value.strip() else []
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise BadRow(f"a {role} cell must be messages or a string, not {type(value).__name__}")


def _require_fast(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise BadTemplate(f"{type(tokenizer).__name__} is a slow tokenizer: chat masking needs "
                          "a fast tokenizer's character offsets; load the model's tokenizer.json "
                          "(transformers AutoTokenizer with use_fast=True)")


def _json_list(value, field: str):
    """A list given as itself or as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise BadRow(f"{field!r} is a string but not valid JSON ({err}); store a list or "
                         "a JSON list") from err
    if not isinstance(value, (list, tuple)):
        raise BadRow(f"{field!r} must be a list (or a JSON string of one), got "
                     f"{type(value).__name__}")
    return list(value)


def _messages(row: Mapping, opts: ChatOptions) -> list[dict]:
    for field in (opts.messages_field, *MESSAGE_FIELDS):
        raw = row.get(field)
        if raw:
            return [_normalise(turn, i) for i, turn in enumerate(_json_list(raw, field))]
    raise SkipRow("no messages")


def _normalise(turn, i: int) -> dict:
    """One message in role/content form, as pgs's normalize_messages writes it."""
    if not isinstance(turn, Mapping):
        raise BadRow(f"message {i} is a {type(turn).__name__}, not a mapping with a role and "
                     "content")
    role_key = next((k for k in ROLE_KEYS if k in turn), None)
    if role_key is None or turn[role_key] is None:
        raise BadRow(f"message {i} has no role: give it one of the keys {', '.join(ROLE_KEYS)}")
    role = str(turn[role_key]).strip().lower()
    role = ROLES.get(role, role)
    content_key = next((k for k in CONTENT_KEYS if k in turn), None)
    if content_key is None:
        others = [k for k in turn if k not in ROLE_KEYS]
        content_key = others[0] if len(others) == 1 else None
    content = turn[content_key] if content_key else None
    dropped = {*ROLE_KEYS, *CONTENT_KEYS, content_key, "reasoning", "think", "function_call"}
    msg = {k: v for k, v in turn.items() if k not in dropped}
    msg.update(role=role, content=content or "")
    if "reasoning_content" not in turn and (turn.get("reasoning") or turn.get("think")):
        msg["reasoning_content"] = turn.get("reasoning") or turn["think"]
    if "function_call" in turn:
        msg["tool_calls"] = [{"function": turn["function_call"]}]
    return msg


def _tools(row: Mapping, opts: ChatOptions) -> list | None:
    tools = row.get(opts.tools_field)
    if tools is None or (isinstance(tools, str) and not tools.strip()):
        return None
    return _json_list(tools, opts.tools_field) or None


def _template_kwargs(row: Mapping, opts: ChatOptions) -> dict:
    own = row.get("chat_template_kwargs")
    if isinstance(own, str):
        try:
            own = json.loads(own)
        except json.JSONDecodeError as err:
            raise BadRow(f"chat_template_kwargs is not valid JSON ({err})") from err
    own = {} if own is None else own
    if not isinstance(own, Mapping):
        raise BadRow(f"chat_template_kwargs must be a mapping, got {type(own).__name__}")
    clash = RESERVED_KWARGS & set(own)
    if clash:
        raise BadRow(f"chat_template_kwargs may not set {sorted(clash)}: encode() sets them")
    return {**opts.chat_template_kwargs, **own}


def _render(tokenizer, messages: list[dict], tools, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=False, **kwargs)


def _render_row(tokenizer, messages: list[dict], tools, kwargs: dict) -> str:
    """The render; on failure BadRow naming the first message whose prefix fails the same way."""
    try:
        return _render(tokenizer, messages, tools, kwargs)
    except Exception as err:  # noqa: BLE001 - jinja errors and Python errors raised in templates
        failure = f"{type(err).__name__}: {err}"
    k = len(messages) - 1
    for end in range(1, len(messages)):
        try:
            _render(tokenizer, messages[:end], tools, kwargs)
        except Exception as err:  # noqa: BLE001
            if f"{type(err).__name__}: {err}" == failure:
                k = end - 1
                break
    raise BadRow(f"the chat template cannot render message {k} (role {messages[k]['role']!r}): "
                 f"{failure}; drop or convert such messages, or use a template that supports them")


def _tokenize(tokenizer, text: str):
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)


def _fit(tokenizer, messages: list[dict], tools, kwargs: dict, max_len: int) -> list[dict]:
    """The longest prefix of whole messages before the first one whose render is too long."""
    keep = 0
    for k in range(1, len(messages)):
        try:
            text = _render(tokenizer, messages[:k], tools, kwargs)
        except Exception:  # noqa: BLE001 - not a place the conversation can end; try the next
            continue
        if len(_tokenize(tokenizer, text)["input_ids"]) > max_len:
            break
        keep = k
    if not any(m["role"] == "assistant" for m in messages[:keep]):
        raise SkipRow("no assistant turn fits max_seq_length")
    return messages[:keep]


def _special_ids(tokenizer) -> frozenset[int]:
    """The named/extra special tokens plus added tokens flagged special (e.g. <|eom_id|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def _texts(msg: Mapping) -> tuple[str | None, list[str]]:
    """(reasoning, answer pieces) as they should appear verbatim in the render: reasoning None if
    none; the answer is one piece for a string content, the stripped text parts (in order) for a
    content given as a list of parts, and no piece when empty."""
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning_content")
    reasoning = reasoning.strip() if isinstance(reasoning, str) and reasoning.strip() else None
    if isinstance(content, (list, tuple)):
        pieces = [part["text"].strip() for part in content
                  if isinstance(part, Mapping) and part.get("type") == "text"
                  and isinstance(part.get("text"), str)]
        return reasoning, [piece for piece in pieces if piece]
    content = content if isinstance(content, str) else str(content)
    if reasoning is None and "</think>" in content:
        head, _, content = content.partition("</think>")
        reasoning = head.split("<think>")[-1].strip() or None
    content = content.strip()
    return reasoning, [content] if content else []


def _turn_weight(j: int, n: int, scaling: str) -> float:
    if n < 2 or scaling == "uniform":
        return 1.0
    if scaling == "progressive":
        return math.sqrt((j + 1) / n)
    return 2.0 if j == n - 1 else 1.0


def _header_finder(tokenizer, messages: list[dict], tools, kwargs: dict,
                   text: str) -> Callable[[int], int]:
    """i -> where message i's text starts after its role header: the length of the render of
    ``messages[:i]`` with the generation prompt, when that render is a prefix of ``text``; else -1
    (the template rewrites history, so the prefix says nothing, or cannot render it)."""
    def header_end(i: int) -> int:
        try:
            prefix = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False,
                                                   add_generation_prompt=True, **kwargs)
        except Exception:  # noqa: BLE001 - no header to find; the caller falls back
            return -1
        return len(prefix) if isinstance(prefix, str) and text.startswith(prefix) else -1
    return header_end


def _weights(text: str, offsets, ids: np.ndarray, messages: list[dict], special: frozenset[int],
             opts: ChatOptions, header_end: Callable[[int], int]) -> np.ndarray:
    """Per-token weights before normalising: the turn weight on the trained tokens of each
    assistant message (its tool call included), 1 on observation tokens, 0 elsewhere."""
    spans = np.asarray(offsets, np.int64).reshape(-1, 2)
    starts, ends = spans[:, 0], spans[:, 1]
    real = ends > starts

    def blank(t: int) -> bool:   # a whitespace-only token (asked only around turn ends)
        return bool(real[t]) and not text[starts[t]:ends[t]].strip()
    is_special = np.isin(ids, np.fromiter(special, np.int64, len(special)))

    def overlapping(c0: int, c1: int) -> list[int]:
        return list(np.flatnonzero(real & (starts < c1) & (ends > c0)))

    def terminator(anchor: int) -> list[int]:
        after = np.flatnonzero(real & (starts >= anchor))
        t = int(after[0]) if after.size else len(ids)
        out = []
        while t < len(ids) and blank(t):
            out.append(t)
            t += 1
        if t < len(ids) and is_special[t]:
            out.append(t)
            if t + 1 < len(ids) and blank(t + 1):
                out.append(t + 1)
        return out

    def turn_end(c0: int) -> int:
        """The first special token from c0 on that ends a turn: past whitespace tokens, another
        special token or the end of the render follows it (-1 if none)."""
        for t in np.flatnonzero(real & is_special & (starts >= c0)):
            u = t + 1
            while u < len(ids) and blank(u):
                u += 1
            if u == len(ids) or is_special[u]:
                return int(t)
        return -1

    def tool_call(i: int, after: int, turn_start: int) -> tuple[int, int] | None:
        """(start char, end-token index) of the call rendered for assistant message i: from
        ``after`` (the end of its answer or reasoning; -1: its header's end) to its turn end."""
        c0 = after if after >= 0 else header_end(i)
        if c0 < turn_start:
            return None
        t = turn_end(c0)
        if t < 0:
            return None
        think = THINK_BLOCK.match(text, c0, int(starts[t]))
        body = think.end() if think else c0
        if not text[body:starts[t]].strip():
            return None          # nothing rendered for the call
        return (c0 if opts.train_on_reasoning else body), t

    assistant = np.zeros(len(ids), np.float32)
    observed = np.zeros(len(ids), bool)
    n = sum(m["role"] == "assistant" for m in messages)
    j = -1
    cursor = 0
    for i, msg in enumerate(messages):
        role, turn_start = msg["role"], cursor
        reasoning, pieces = _texts(msg)
        r0 = r1 = -1
        if reasoning and (r0 := text.find(reasoning, cursor)) >= 0:
            r1 = cursor = r0 + len(reasoning)
        answer = []                                        # located (start, end) of each piece
        for piece in pieces:
            if (a0 := text.find(piece, cursor)) >= 0:
                cursor = a0 + len(piece)
                answer.append((a0, cursor))
        call = None
        if role == "assistant" and msg.get("tool_calls"):
            call = tool_call(i, answer[-1][1] if answer else r1, turn_start)
            cursor = int(ends[call[1]]) if call else cursor
        if role == "assistant":
            j += 1
            if opts.last_turn_only and j != n - 1:
                continue
        elif not (opts.include_observations and role in OBSERVATION_ROLES):
            continue
        index = []
        for k, (a0, a1) in enumerate(answer):
            index += overlapping(a0, a1)
            if k and not text[answer[k - 1][1]:a0].strip():
                index += overlapping(answer[k - 1][1], a0)        # whitespace between parts
        end = answer[-1][1] if answer else -1
        if role == "assistant" and opts.train_on_reasoning and r0 >= 0:
            opener = text.rfind("<think>", turn_start, r0)
            index += overlapping(r0 if opener < 0 else opener, answer[0][0] if answer else r1)
            end = end if answer else r1
        if end >= 0:
            index += terminator(end)
        if call:
            c0, t = call
            index += overlapping(c0, int(starts[t])) + terminator(int(starts[t]))
        if role == "assistant":
            assistant[index] = _turn_weight(j, n, opts.turn_scaling)
        else:
            observed[index] = True
    if opts.include_observations:
        for opening, closing in ECHO_MARKERS:
            at = text.find(opening)
            while at >= 0:
                c0 = at + len(opening)
                c1 = text.find(closing, c0)
                c1 = len(text) if c1 < 0 else c1
                observed[overlapping(c0, c1)] = True
                at = text.find(opening, c1 + len(closing))
    return np.where(assistant > 0, assistant, observed.astype(np.float32))
