"""Chat rows -> ids and loss weights (jaxtrain.data.chat), token-exact on real chat templates.

The templates are the models' own (tests/data/chat_templates/*.jinja). The tokenizers are tiny
byte-level BPEs trained here, with each family's added tokens marked as the real tokenizer marks
them: Llama 3 adds its <|...|> tokens as special, prepends <|begin_of_text|> for
add_special_tokens=True and ends turns with eos <|eot_id|>; Qwen3's <|im_start|>, <|im_end|> and
<|endoftext|> are special while <think>, <tool_call>, <tool_response> are added but not special;
Mistral's control tokens ([INST], [TOOL_CALLS], [CALL_ID], [ARGS], ...) are special.

Expected trained tokens are written as the decoded runs of consecutive trained positions. Byte-level
tokens cover the render without gaps, so a run's text fixes its first and last token exactly.
"""
import functools
import json
import math
import pathlib
import sys

import numpy as np
import pytest

from jaxtrain.data.chat import BadRow, BadTemplate, ChatOptions, SkipRow, check_template, encode

TEMPLATES = pathlib.Path(__file__).parent / "chat_templates"
PGS_SRC = pathlib.Path("/work/corpus/palingenesis/src")
CORPUS = ["the cat sat on the mat and the dog ran far", "What is the weather in Paris today?",
          "It is sunny and 22 C in Paris.", "Cutting Knowledge Date: December 2023"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
              "</think>"]
MISTRAL_SPECIAL = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]",
                   "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]


def _bpe(special, plain=()):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tok


def template(name):
    return (TEMPLATES / f"{name}.jinja").read_text()


def llama(name="llama31", chat_template=None):
    """A Llama-3-style tokenizer with the llama3 or llama31 template (or the one given)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _bpe(LLAMA_SPECIAL)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>")
    fast.chat_template = chat_template or template(name)
    return fast


def qwen3(chat_template=None):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(QWEN_SPECIAL, QWEN_PLAIN),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = chat_template or template("qwen3")
    return fast


def mistral():
    """Mistral Small 3.2: the template writes <s>; turns end with eos </s>."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(MISTRAL_SPECIAL), bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = template("mistral_small32")
    return fast


@functools.cache
def tokenizer(name):
    return {"qwen3": qwen3, "mistral": mistral}.get(name, functools.partial(llama, name))()


def run_indices(enc):
    """The positions of each maximal run of consecutive trained tokens."""
    trained = np.flatnonzero(enc.weights > 0)
    return np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1) if trained.size else []


def runs(tok, enc):
    """The decoded text of each run of trained tokens."""
    return [tok.decode(enc.ids[run].tolist()) for run in run_indices(enc)]


def same(a, b):
    return a.ids.tolist() == b.ids.tolist() and a.weights.tolist() == b.weights.tolist()


def rendered_ids(tok, messages, **kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def user(text):
    return {"role": "user", "content": text}


def assistant(text, reasoning=None, **extra):
    msg = {"role": "assistant", "content": text, **extra}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def opts(**kwargs):
    return ChatOptions(max_seq_length=kwargs.pop("max_seq_length", 4096), **kwargs)


SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [SYSTEM, user("What is the weather?"), assistant("It is sunny."),
        user("And the cat?"), assistant("The cat sat on the mat."),
        user("Where is the dog?"), assistant("The dog ran far.")]
ANSWERS = ["It is sunny.", "The cat sat on the mat.", "The dog ran far."]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOL_RESULT = {"role": "tool", "content": "sunny, 22 C"}
FINAL = "It is sunny and 22 C in Paris."
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call(city, name="get_weather", key="city"):
    return [{"type": "function", "function": {"name": name, "arguments": {key: city}}}]


# ---------------------------------------------------------------------------------------------
# Llama 3 (no tools, no reasoning support in the template)


@pytest.mark.parametrize("last_turn_only", [False, True])
def test_llama3_assistant_turns(last_turn_only):
    """Each answer plus its <|eot_id|>; the next header is not whitespace, so nothing after it.
    The template writes BOS itself: the ids are the render's tokens without a second BOS."""
    tok = tokenizer("llama3")
    enc = encode({"messages": CHAT}, tok, opts(last_turn_only=last_turn_only))
    assert enc.ids.dtype == np.int32 and enc.weights.dtype == np.float32
    assert enc.ids.tolist() == rendered_ids(tok, CHAT)
    assert enc.ids[0] == tok.bos_token_id and enc.ids[1] != tok.bos_token_id
    expected = [a + "<|eot_id|>" for a in ANSWERS]
    assert runs(tok, enc) == (expected[-1:] if last_turn_only else expected)


@pytest.mark.parametrize("train_on_reasoning", [False, True])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_llama3_think_in_content(train_on_reasoning, last_turn_only):
    """<think>...</think> inside the content: the template keeps it in every turn; the knob
    decides whether the block (from its opener) is trained with the answer."""
    tok = tokenizer("llama3")
    chat = [user("What is the weather?"), assistant("<think>look outside</think>It is sunny."),
            user("And the cat?"), assistant("<think>cats sit</think>The cat sat on the mat.")]
    enc = encode({"messages": chat}, tok, opts(train_on_reasoning=train_on_reasoning,
                                               last_turn_only=last_turn_only))
    if train_on_reasoning:
        expected = ["<think>look outside</think>It is sunny.<|eot_id|>",
                    "<think>cats sit</think>The cat sat on the mat.<|eot_id|>"]
    else:
        expected = ["It is sunny.<|eot_id|>", "The cat sat on the mat.<|eot_id|>"]
    assert runs(tok, enc) == (expected[-1:] if last_turn_only else expected)


@pytest.mark.parametrize("include_observations", [False, True])
def test_llama3_tool_role(include_observations):
    """Llama 3 renders a tool message under a plain 'tool' header; ECHO trains it like a turn."""
    tok = tokenizer("llama3")
    chat = [user("What is the weather?"), assistant("Let me look."), TOOL_RESULT, assistant(FINAL)]
    enc = encode({"messages": chat}, tok, opts(include_observations=include_observations))
    observed = ["sunny, 22 C<|eot_id|>"] if include_observations else []
    assert runs(tok, enc) == ["Let me look.<|eot_id|>", *observed, FINAL + "<|eot_id|>"]


# ---------------------------------------------------------------------------------------------
# Llama 3.1 (tools in the first user message, tool calls as JSON, tool results as ipython)

LLAMA_TOOL_CHAT = [user("Hi"), assistant("Hello."), user("What is the weather in Paris?"),
                   assistant("", tool_calls=CALL), TOOL_RESULT, assistant(FINAL)]


@pytest.mark.parametrize("include_observations", [False, True])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_llama31_tools(include_observations, last_turn_only):
    """The tool call ({"name": ..., "parameters": ...}) has no content: it is trained from the
    assistant header's end (the render of the messages before it with the generation prompt)
    through its <|eot_id|>, as a turn of its own (so not with last_turn_only). The ipython result
    is rendered as a JSON string, so the trained observation is the text inside the quotes (the
    closing quote stops the terminator); it is trained whatever last_turn_only says."""
    tok = tokenizer("llama31")
    enc = encode({"messages": LLAMA_TOOL_CHAT, "tools": TOOLS}, tok,
                 opts(include_observations=include_observations, last_turn_only=last_turn_only))
    text = tok.decode(enc.ids)
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{LLAMA_CALL}<|eot_id|>" in text
    assert '"name": "get_weather",\n        "description"' in text    # the tools, in user turn 1
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 22 C"<|eot_id|>' in text
    expected = [] if last_turn_only else ["Hello.<|eot_id|>", LLAMA_CALL + "<|eot_id|>"]
    expected += ["sunny, 22 C"] if include_observations else []
    assert runs(tok, enc) == expected + [FINAL + "<|eot_id|>"]


def test_llama31_builtin_tool_call():
    """ipython mode (builtin_tools): calls end with <|eom_id|>, and a built-in one starts with the
    special <|python_tag|>. The call ends at the first special token that another special token
    (or the render's end) follows, so <|python_tag|> does not end it. Llama 3.1 does not render
    the content of a message with tool calls, so 'Let me search.' is not found and the call is
    located after the header."""
    tok = tokenizer("llama31")
    chat = [user("What is the weather in Paris?"),
            assistant("Let me search.", tool_calls=call("weather Paris", "brave_search", "query")),
            TOOL_RESULT, assistant("", tool_calls=CALL), TOOL_RESULT, assistant(FINAL)]
    row = {"messages": chat, "tools": TOOLS,
           "chat_template_kwargs": {"builtin_tools": ["brave_search"]}}
    enc = encode(row, tok, opts())
    search = '<|python_tag|>brave_search.call(query="weather Paris")<|eom_id|>'
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{search}" in tok.decode(enc.ids)
    assert "Let me search." not in tok.decode(enc.ids)
    assert runs(tok, enc) == [search, LLAMA_CALL + "<|eom_id|>", FINAL + "<|eot_id|>"]


# ---------------------------------------------------------------------------------------------
# Qwen3 (reasoning_content, <think> dropped from turns before the last user query, tools)

QWEN_CHAT = [SYSTEM, user("What is the weather?"), assistant("It is sunny.", "look outside"),
             user("And the cat?"), assistant("The cat sat on the mat.", "cats sit")]


@pytest.mark.parametrize("train_on_reasoning", [False, True])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_qwen3_reasoning(train_on_reasoning, last_turn_only):
    """The first turn's reasoning is not rendered (it precedes the last user query), so only its
    answer can be trained; the last turn trains from <think> when train_on_reasoning. The
    terminator is <|im_end|> and the newline after it."""
    tok = tokenizer("qwen3")
    enc = encode({"messages": QWEN_CHAT}, tok, opts(train_on_reasoning=train_on_reasoning,
                                                    last_turn_only=last_turn_only))
    text = tok.decode(enc.ids)
    assert "look outside" not in text
    assert "<|im_start|>assistant\n<think>\ncats sit\n</think>\n\nThe cat sat on the mat." in text
    last = ("<think>\ncats sit\n</think>\n\n" if train_on_reasoning else "") + \
        "The cat sat on the mat.<|im_end|>\n"
    expected = [last] if last_turn_only else ["It is sunny.<|im_end|>\n", last]
    assert runs(tok, enc) == expected


def test_qwen3_think_in_content_same_as_reasoning_content():
    tok = tokenizer("qwen3")
    inline = [dict(m) for m in QWEN_CHAT]
    for m in inline:
        if m.get("reasoning_content"):
            m["content"] = f"<think>{m.pop('reasoning_content')}</think>{m['content']}"
    assert same(encode({"messages": QWEN_CHAT}, tok, opts()),
                encode({"messages": inline}, tok, opts()))


QWEN_TOOL_CHAT = [user("What is the weather in Paris?"),
                  assistant("", "I should call the tool", tool_calls=CALL), TOOL_RESULT,
                  assistant(FINAL, "The tool says sunny")]


@pytest.mark.parametrize("train_on_reasoning", [False, True])
@pytest.mark.parametrize("include_observations", [False, True])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_qwen3_tools(train_on_reasoning, include_observations, last_turn_only):
    """After the last user query Qwen3 renders the tool-call turn's reasoning. That turn has no
    answer, so its call is trained from the end of the reasoning through <|im_end|> and the
    newline: with train_on_reasoning the whole turn from <think> is one run; without it the
    '</think>' closer and the whitespace after it are left out, so the run starts at <tool_call>.
    The tool result sits in a user turn between <tool_response> markers: ECHO trains the text
    between them."""
    tok = tokenizer("qwen3")
    enc = encode({"messages": QWEN_TOOL_CHAT, "tools": TOOLS}, tok,
                 opts(train_on_reasoning=train_on_reasoning, last_turn_only=last_turn_only,
                      include_observations=include_observations))
    text = tok.decode(enc.ids)
    assert ("<|im_start|>assistant\n<think>\nI should call the tool\n</think>\n\n"
            f"{QWEN_CALL}<|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 22 C\n</tool_response><|im_end|>\n" in text
    expected = []
    if not last_turn_only:
        thought = "<think>\nI should call the tool\n</think>\n\n" if train_on_reasoning else ""
        expected.append(thought + QWEN_CALL + "<|im_end|>\n")
    if include_observations:
        expected.append("\nsunny, 22 C\n")
    reasoning = "<think>\nThe tool says sunny\n</think>\n\n" if train_on_reasoning else ""
    expected.append(reasoning + FINAL + "<|im_end|>\n")
    assert runs(tok, enc) == expected


QWEN_STEPS = [user("What is the weather in Paris?"),
              assistant("", "I should call the tool", tool_calls=CALL), TOOL_RESULT,
              assistant("Let me check London and Berlin.",
                        tool_calls=call("London") + call("Berlin")),
              {"role": "tool", "content": "rainy, 14 C"},
              assistant("", tool_calls=call("Rome")), {"role": "tool", "content": "hot, 30 C"},
              assistant(FINAL), user("Thanks!"), assistant("You are welcome.", "be polite")]


def qwen_call(city):
    return QWEN_CALL.replace("Paris", city)


@pytest.mark.parametrize("train_on_reasoning", [False, True])
def test_qwen3_tool_calls_in_rewritten_history(train_on_reasoning):
    """Tool calls before the last user query, where Qwen3 drops the reasoning. The Paris call
    has no content and its reasoning is not rendered: it is trained from the header's end, found
    with the render of the messages before it plus the generation prompt. The London and Berlin
    calls follow their content and are trained from its end (with the newline Qwen3 puts before
    each call) through the turn's end. The Rome call has neither, and its header cannot be found:
    the messages before it render the Paris turn's reasoning (then after the last user query),
    which the full render drops, so that render is not a prefix of the full one; the call stays
    untrained, as in pgs."""
    tok = tokenizer("qwen3")
    enc = encode({"messages": QWEN_STEPS, "tools": TOOLS}, tok,
                 opts(train_on_reasoning=train_on_reasoning))
    text = tok.decode(enc.ids)
    assert "I should call the tool" not in text
    assert f"<|im_start|>assistant\n{QWEN_CALL}<|im_end|>\n" in text
    assert f"<|im_start|>assistant\n{qwen_call('Rome')}<|im_end|>\n" in text
    prefix = tok.apply_chat_template(QWEN_STEPS[:5], tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    assert "I should call the tool" in prefix and not text.startswith(prefix)
    last = ("<think>\nbe polite\n</think>\n\n" if train_on_reasoning else "") + \
        "You are welcome.<|im_end|>\n"
    assert runs(tok, enc) == [QWEN_CALL + "<|im_end|>\n",
                              f"Let me check London and Berlin.\n{qwen_call('London')}\n"
                              f"{qwen_call('Berlin')}<|im_end|>\n",
                              FINAL + "<|im_end|>\n", last]


@pytest.mark.parametrize("train_on_reasoning", [False, True])
def test_qwen3_tool_call_after_empty_think_block(train_on_reasoning):
    """A last turn without reasoning gets an empty <think> block from Qwen3. The call is trained
    from the header's end, that block included only with train_on_reasoning."""
    tok = tokenizer("qwen3")
    chat = [user("What is the weather in Paris?"), assistant("", tool_calls=CALL)]
    enc = encode({"messages": chat, "tools": TOOLS}, tok,
                 opts(train_on_reasoning=train_on_reasoning))
    block = "<think>\n\n</think>\n\n"
    assert tok.decode(enc.ids).endswith(f"<|im_start|>assistant\n{block}{QWEN_CALL}<|im_end|>\n")
    assert runs(tok, enc) == [(block if train_on_reasoning else "") + QWEN_CALL + "<|im_end|>\n"]


# ---------------------------------------------------------------------------------------------
# Mistral Small 3.2 (content as a list of parts, special tokens inside a tool call)

MISTRAL_CALL = [{"id": "call12345", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
MISTRAL_CHAT = [SYSTEM,
                user([{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]),
                assistant([{"type": "text", "text": "The cat sat"},
                           {"type": "text", "text": " on the mat."}]),
                user("What is the weather in Paris?"),
                assistant("", tool_calls=MISTRAL_CALL),
                {"role": "tool", "tool_call_id": "call12345", "content": "sunny, 22 C"},
                assistant(FINAL)]


@pytest.mark.parametrize("include_observations", [False, True])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_mistral_content_parts_and_tool_call(include_observations, last_turn_only):
    """A content of text parts is located part by part, in order; the whitespace between two
    parts is trained with them. The call holds special tokens followed by text ([TOOL_CALLS],
    [CALL_ID], [ARGS]); it ends at </s>, the first special token followed by another one. The
    tool result's terminator is [/TOOL_RESULTS], right before the final answer."""
    tok = tokenizer("mistral")
    enc = encode({"messages": MISTRAL_CHAT, "tools": TOOLS}, tok,
                 opts(include_observations=include_observations, last_turn_only=last_turn_only))
    text = tok.decode(enc.ids)
    mistral_call = '[TOOL_CALLS]get_weather[CALL_ID]call12345[ARGS]{"city": "Paris"}</s>'
    assert text.startswith("<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]What is in this "
                           "picture?[IMG][/INST]The cat sat on the mat.</s>[AVAILABLE_TOOLS]")
    assert text.endswith(f"[/INST]{mistral_call}[TOOL_RESULTS]call12345[TOOL_CONTENT]sunny, 22 C"
                         f"[/TOOL_RESULTS]{FINAL}</s>")
    expected = [] if last_turn_only else ["The cat sat on the mat.</s>", mistral_call]
    final = FINAL + "</s>"
    expected += ["sunny, 22 C[/TOOL_RESULTS]" + final] if include_observations else [final]
    assert runs(tok, enc) == expected


def test_content_parts_same_as_string():
    tok = tokenizer("mistral")
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    assert same(encode({"messages": parts}, tok, opts()), encode({"messages": CHAT}, tok, opts()))


# ---------------------------------------------------------------------------------------------
# Turn weights


def _expected_weights(counts, raw):
    """Per-turn weights after dividing by the mean over trained tokens (counts tokens per turn)."""
    mean = sum(c * w for c, w in zip(counts, raw)) / sum(counts)
    return [w / mean for w in raw]


@pytest.mark.parametrize("scaling, raw", [
    ("uniform", [1.0, 1.0, 1.0]),
    ("progressive", [math.sqrt(1 / 3), math.sqrt(2 / 3), 1.0]),
    ("last_heavy", [1.0, 1.0, 2.0]),
])
def test_turn_scaling(scaling, raw):
    tok = tokenizer("llama3")
    enc = encode({"messages": CHAT}, tok, opts(turn_scaling=scaling))
    turns = run_indices(enc)
    assert [tok.decode(enc.ids[t].tolist()) for t in turns] == [a + "<|eot_id|>" for a in ANSWERS]
    expected = _expected_weights([len(t) for t in turns], raw)
    for t, w in zip(turns, expected):
        np.testing.assert_allclose(enc.weights[t], w, rtol=1e-6)
    assert np.isclose(enc.weights[enc.weights > 0].mean(), 1.0, rtol=1e-6)
    untrained = np.setdiff1d(np.arange(len(enc.ids)), np.concatenate(turns))
    assert (enc.weights[untrained] == 0).all()


@pytest.mark.parametrize("scaling", ["progressive", "last_heavy"])
def test_turn_scaling_with_observations(scaling):
    """Observation tokens weigh 1 before the division; the assistant turns are counted 0, 1, 2
    and the tool call is turn 1."""
    tok = tokenizer("llama31")
    enc = encode({"messages": LLAMA_TOOL_CHAT, "tools": TOOLS}, tok,
                 opts(turn_scaling=scaling, include_observations=True))
    turns = run_indices(enc)
    assert runs(tok, enc) == ["Hello.<|eot_id|>", LLAMA_CALL + "<|eot_id|>", "sunny, 22 C",
                              FINAL + "<|eot_id|>"]
    raw = ([math.sqrt(1 / 3), math.sqrt(2 / 3), 1.0, 1.0] if scaling == "progressive"
           else [1.0, 1.0, 1.0, 2.0])
    expected = _expected_weights([len(t) for t in turns], raw)
    for t, w in zip(turns, expected):
        np.testing.assert_allclose(enc.weights[t], w, rtol=1e-6)
    assert np.isclose(enc.weights[enc.weights > 0].mean(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("chat, options", [
    (CHAT, dict(turn_scaling="progressive", last_turn_only=True)),
    (CHAT[:3], dict(turn_scaling="last_heavy")),
])
def test_turn_scaling_single_trained_turn(chat, options):
    """One trained assistant turn: every trained token weighs 1."""
    enc = encode({"messages": chat}, tokenizer("llama3"), opts(**options))
    assert set(enc.weights[enc.weights > 0].tolist()) == {1.0}


# ---------------------------------------------------------------------------------------------
# One masking path: what HF's {% generation %} mask trains, we train


def _hf_mask(tok, messages, **kwargs):
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kwargs)
    return enc["input_ids"], np.asarray(enc["assistant_masks"], bool)


def test_generation_span_llama31():
    """Llama 3.1 with {% generation %} around the trimmed content and around the JSON of a tool
    call (as trainers commonly add it): HF's assistant mask is the content and the call; ours is
    exactly that plus each assistant turn's <|eot_id|>, the end-of-turn token of pgs's terminator
    rule, the tool-call turn's included. The render is unchanged."""
    turn = ("'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
            "+ message['content'] | trim + '<|eot_id|>'")
    call_start = "{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
    call_end = '{{- "}" }}'
    src = template("llama31")
    assert src.count(turn) == src.count(call_start) == src.count(call_end) == 1
    src = src.replace(call_start, "{%- generation %}" + call_start)
    src = src.replace(call_end, call_end + "{%- endgeneration %}")
    tok = llama(chat_template=src.replace("{{- " + turn + " }}", (
        "{%- if message.role == 'assistant' %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- generation %}{{- message['content'] | trim }}{%- endgeneration %}"
        "{{- '<|eot_id|>' }}{%- else %}{{- " + turn + " }}{%- endif %}")))
    for chat, tools in ((CHAT, None), (LLAMA_TOOL_CHAT, TOOLS)):
        ids, hf = _hf_mask(tok, chat, tools=tools)
        enc = encode({"messages": chat, "tools": tools}, tok, opts())
        assert enc.ids.tolist() == ids == rendered_ids(tokenizer("llama31"), chat, tools=tools)
        ours = enc.weights > 0
        assert not (hf & ~ours).any()
        assert tok.convert_ids_to_tokens(enc.ids[ours & ~hf].tolist()) == ["<|eot_id|>"] * 3
    assert runs(tok, enc)[1] == LLAMA_CALL + "<|eot_id|>"


def test_generation_span_qwen3():
    """Qwen3 with {% generation %} over everything after each 'assistant\\n' header through
    '<|im_end|>\\n': with train_on_reasoning the masks are identical, rewritten history and tool
    calls included (a call after its reasoning, after its content, or after the header). The one
    difference left: a call with no content and no rendered reasoning whose header cannot be
    found, because the render of the messages before it is not a prefix of the full render (the
    Rome call of QWEN_STEPS), is trained by HF's span and not by us."""
    src = template("qwen3")
    header = "{{- '<|im_start|>' + message.role + '\\n"
    think = ("<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
             " + content.lstrip('\\n') }}")
    end = "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    edits = [  # (old, new, occurrences)
        (header + think, header + "' }}{%- generation %}{{- '" + think + "{%- endgeneration %}", 1),
        (header + "' + content }}",
         header + "' }}{%- generation %}{{- content }}{%- endgeneration %}", 2),
        ("{%- if message.tool_calls %}", "{%- generation %}{%- if message.tool_calls %}", 1),
        (end, end.replace(" }}", " }}{%- endgeneration %}", 1), 1),
    ]
    for old, new, count in edits:
        assert src.count(old) == count, old
        src = src.replace(old, new)
    tok = qwen3(chat_template=src)
    for chat, tools in ((QWEN_CHAT, None), (QWEN_TOOL_CHAT, TOOLS), (QWEN_STEPS, TOOLS)):
        ids, hf = _hf_mask(tok, chat, tools=tools)
        enc = encode({"messages": chat, "tools": tools}, tok, opts())
        assert enc.ids.tolist() == ids == rendered_ids(tokenizer("qwen3"), chat, tools=tools)
        ours = enc.weights > 0
        assert not (ours & ~hf).any()
        only_hf = np.flatnonzero(hf & ~ours)
        if chat is not QWEN_STEPS:
            assert only_hf.size == 0
    assert np.all(np.diff(only_hf) == 1)
    assert tok.decode(enc.ids[only_hf].tolist()) == qwen_call("Rome") + "<|im_end|>\n"


# ---------------------------------------------------------------------------------------------
# max_seq_length


def test_truncation_drops_whole_messages():
    tok = tokenizer("llama3")
    sizes = {k: len(rendered_ids(tok, CHAT[:k])) for k in range(1, len(CHAT) + 1)}
    enc = encode({"messages": CHAT}, tok, opts(max_seq_length=sizes[len(CHAT)]))
    assert enc.ids.tolist() == rendered_ids(tok, CHAT)
    for keep in (3, 4, 5):      # ends after answer 1, after user 2 (kept, as pgs keeps it), ...
        enc = encode({"messages": CHAT}, tok, opts(max_seq_length=sizes[keep + 1] - 1))
        assert enc.ids.tolist() == rendered_ids(tok, CHAT[:keep])
        assert runs(tok, enc) == [a + "<|eot_id|>" for a in ANSWERS[:(keep - 1) // 2]]
    with pytest.raises(SkipRow) as info:
        encode({"messages": CHAT}, tok, opts(max_seq_length=sizes[3] - 1))
    assert info.value.reason == "no assistant turn fits max_seq_length"


def test_truncation_passes_over_prefixes_the_template_cannot_render():
    """With tools, Llama 3.1 cannot render the system message alone (the tools go into the first
    user message): that prefix is no place to cut, but the search goes on past it."""
    tok = tokenizer("llama31")
    chat = [SYSTEM] + LLAMA_TOOL_CHAT
    kept = rendered_ids(tok, chat[:3], tools=TOOLS)
    enc = encode({"messages": chat, "tools": TOOLS}, tok, opts(max_seq_length=len(kept)))
    assert enc.ids.tolist() == kept
    assert runs(tok, enc) == ["Hello.<|eot_id|>"]


def test_truncation_cuts_tokens_when_the_kept_prefix_renders_longer():
    """Only a template whose render of the same messages changes between calls is cut mid-text."""
    tok = llama("llama3")
    render, seen = tok.apply_chat_template, []

    def drifting(messages, **kwargs):
        seen.append(len(messages))
        text = render(messages, **kwargs)
        return text + " the cat" * 20 if seen.count(len(messages)) > 1 else text

    tok.apply_chat_template = drifting
    clean = rendered_ids(tokenizer("llama3"), CHAT[:4])
    drift = tok(" the cat" * 20, add_special_tokens=False)["input_ids"]
    enc = encode({"messages": CHAT}, tok, opts(max_seq_length=len(clean) + 3))
    assert enc.ids.tolist() == clean + drift[:3]
    assert runs(tok, enc) == ["It is sunny.<|eot_id|>"]


# ---------------------------------------------------------------------------------------------
# Rows: fields, normalisation, errors


@pytest.mark.parametrize("field", ["conversations", "conversation", "chat", "dialogue", "turns"])
def test_messages_field_fallbacks(field):
    tok = tokenizer("llama3")
    base = encode({"messages": CHAT}, tok, opts())
    for row, options in (({field: CHAT}, opts()), ({"messages": [], field: CHAT}, opts()),
                         ({"dialog": json.dumps(CHAT)}, opts(messages_field="dialog"))):
        assert same(encode(row, tok, options), base)


@pytest.mark.parametrize("row", [{}, {"messages": []}, {"messages": None, "text": "hello"}])
def test_no_messages_is_skipped(row):
    with pytest.raises(SkipRow) as info:
        encode(row, tokenizer("llama3"), opts())
    assert info.value.reason == "no messages"


def test_sharegpt_normalisation():
    """from/value, human/gpt/function roles, and reasoning/think keys, as pgs normalises them."""
    sharegpt = [{"from": "system", "value": "Be brief."},
                {"from": "human", "value": "What is the weather?"},
                {"from": "gpt", "value": "It is sunny."},
                {"from": "Human", "value": "And the cat?"},
                {"from": "GPT", "value": "The cat sat on the mat.", "think": "cats sit"}]
    plain = QWEN_CHAT[:2] + [assistant("It is sunny.")] + QWEN_CHAT[3:]
    tok = tokenizer("qwen3")
    assert same(encode({"conversations": sharegpt}, tok, opts()),
                encode({"messages": plain}, tok, opts()))
    chat = [user("What is the weather?"), assistant("Let me look."),
            {"role": "function", "content": "sunny, 22 C"},
            {"role": "ai", "content": FINAL, "reasoning": "ok"}]
    enc = encode({"messages": chat}, tok, opts(include_observations=True))
    assert "<tool_response>\nsunny, 22 C\n</tool_response>" in tok.decode(enc.ids)
    assert runs(tok, enc)[-1] == f"<think>\nok\n</think>\n\n{FINAL}<|im_end|>\n"


@pytest.mark.parametrize("messages, fragment", [
    ([user("hi"), "not a message"], "message 1 is a str"),
    ([user("hi"), {"content": "no role here", "weight": 1}], "message 1 has no role"),
    ([{"role": None, "content": "hi"}], "message 0 has no role"),
    ({"role": "user", "content": "hi"}, "must be a list"),
    ("[not json", "not valid JSON"),
])
def test_malformed_messages(messages, fragment):
    with pytest.raises(BadRow, match=fragment):
        encode({"messages": messages}, tokenizer("llama3"), opts())


def test_role_the_template_cannot_render():
    strict = ("{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
              "{{- raise_exception('Unsupported role: ' + m.role) }}{%- endif %}{%- endfor %}")
    tok = llama(chat_template=strict + template("llama3"))
    chat = [user("What is the weather?"), assistant("Let me look."), TOOL_RESULT, assistant(FINAL)]
    with pytest.raises(BadRow, match=r"message 2 \(role 'tool'\).*Unsupported role: tool"):
        encode({"messages": chat}, tok, opts())
    assert runs(tok, encode({"messages": CHAT}, tok, opts()))[0] == "It is sunny.<|eot_id|>"


@pytest.mark.parametrize("chat, options", [
    ([user("Only a question?")], opts()),
    ([user("Q?"), assistant("", "just thinking")], opts(train_on_reasoning=False)),
])
def test_no_trained_tokens_is_skipped(chat, options):
    with pytest.raises(SkipRow) as info:
        encode({"messages": chat}, tokenizer("qwen3"), options)
    assert info.value.reason == "no trained tokens"


# ---------------------------------------------------------------------------------------------
# Tools and template arguments


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_tools_list_or_json_string(name):
    tok = tokenizer(name)
    chat = LLAMA_TOOL_CHAT if name == "llama31" else QWEN_TOOL_CHAT
    as_list = encode({"messages": chat, "tools": TOOLS}, tok, opts())
    as_json = encode({"messages": chat, "tools": json.dumps(TOOLS)}, tok, opts())
    other = encode({"messages": chat, "functions": TOOLS}, tok, opts(tools_field="functions"))
    assert '"description": "Weather in a city"' in tok.decode(as_list.ids)
    assert same(as_json, as_list) and same(other, as_list)
    none = encode({"messages": chat}, tok, opts())
    for empty in ([], ""):
        assert same(encode({"messages": chat, "tools": empty}, tok, opts()), none)
    assert "Weather in a city" not in tok.decode(none.ids)
    with pytest.raises(BadRow, match="'tools' is a string but not valid JSON"):
        encode({"messages": chat, "tools": "{oops"}, tok, opts())


def test_chat_template_kwargs_per_file_and_row():
    """Llama 3.1 reads date_string: the file's value, overridden by the row's own."""
    tok = tokenizer("llama31")
    file_opts = opts(chat_template_kwargs={"date_string": "01 Jan 2025"})
    text = tok.decode(encode({"messages": CHAT}, tok, file_opts).ids)
    assert "Today Date: 01 Jan 2025\n" in text
    row = {"messages": CHAT, "chat_template_kwargs": {"date_string": "02 Feb 2026"}}
    assert "Today Date: 02 Feb 2026\n" in tok.decode(encode(row, tok, file_opts).ids)
    assert "Today Date: 26 Jul 2024\n" in tok.decode(encode({"messages": CHAT}, tok, opts()).ids)


def test_enable_thinking_does_not_change_training_tokens():
    """Qwen3's enable_thinking reaches the template (per file, per row) but only acts on the
    generation prompt, which SFT rendering never adds: the encoding is unchanged."""
    tok = tokenizer("qwen3")
    base = encode({"messages": QWEN_CHAT}, tok, opts())
    off, on = {"enable_thinking": False}, {"enable_thinking": True}
    for row_kwargs, file_kwargs in ((None, off), (off, {}), (json.dumps(on), off)):
        row = {"messages": QWEN_CHAT, "chat_template_kwargs": row_kwargs}
        assert same(encode(row, tok, opts(chat_template_kwargs=file_kwargs)), base)


def test_reserved_template_kwargs():
    with pytest.raises(ValueError, match="add_generation_prompt"):
        opts(chat_template_kwargs={"add_generation_prompt": True})
    with pytest.raises(BadRow, match="tokenize"):
        encode({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, tokenizer("llama3"),
               opts())
    with pytest.raises(BadRow, match="must be a mapping"):
        encode({"messages": CHAT, "chat_template_kwargs": [1]}, tokenizer("llama3"), opts())


def test_options_are_checked():
    with pytest.raises(ValueError, match="turn_scaling"):
        opts(turn_scaling="linear")
    with pytest.raises(ValueError, match="max_seq_length"):
        opts(max_seq_length=0)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        opts(chat_template_kwargs=["enable_thinking"])
    assert opts(chat_template_kwargs=None).chat_template_kwargs == {}


# ---------------------------------------------------------------------------------------------
# Templates and tokenizers that cannot be used


@pytest.mark.parametrize("name", ["llama3", "llama31", "qwen3", "mistral"])
def test_real_templates_pass_the_check(name):
    check_template(tokenizer(name), opts())


@pytest.mark.parametrize("chat_template, fragment", [
    (None, "no chat template"),
    ("{% for m in messages %}{{ m.content }}\n{% endfor %}", "no assistant marker"),
    ("{% for m in messages %}<{{ m.role }}>{% endfor %}", "does not render message contents"),
    ("{{ raise_exception('no chat here') }}", "cannot render a user/assistant.*no chat here"),
])
def test_bad_template(chat_template, fragment):
    tok = llama()
    tok.chat_template = chat_template
    with pytest.raises(BadTemplate, match=fragment):
        check_template(tok, opts())


def test_slow_tokenizer_is_rejected():
    class Slow:
        is_fast = False
        chat_template = template("llama3")

    with pytest.raises(BadTemplate, match="fast tokenizer"):
        check_template(Slow(), opts())
    with pytest.raises(BadTemplate, match="fast tokenizer"):
        encode({"messages": CHAT}, Slow(), opts())


# ---------------------------------------------------------------------------------------------
# Side by side with palingenesis's ChatDataset (needs its checkout and torch)


@pytest.fixture(scope="module")
def pgs_chat_dataset():
    if not (PGS_SRC / "palingenesis" / "data.py").exists():
        pytest.skip("no palingenesis checkout")
    pytest.importorskip("torch")
    sys.path.append(str(PGS_SRC))      # appended: its package's logging.py must not shadow stdlib's
    try:
        from palingenesis.data import ChatDataset
    finally:
        sys.path.remove(str(PGS_SRC))
    return ChatDataset


@pytest.mark.parametrize("name, chat", [("llama3", CHAT), ("llama31", LLAMA_TOOL_CHAT),
                                        ("qwen3", QWEN_CHAT), ("qwen3", QWEN_TOOL_CHAT)])
@pytest.mark.parametrize("options", [
    {}, {"train_on_reasoning": False}, {"last_turn_only": True}, {"include_observations": True},
    {"turn_scaling": "progressive"}, {"turn_scaling": "last_heavy", "include_observations": True},
])
def test_matches_palingenesis(pgs_chat_dataset, name, chat, options):
    """Same ids, trained positions and weights as pgs's ChatDataset (its offset masker: these
    templates have no generation span; rows without tools=, which pgs never passes) for the
    conversations without tool calls. In those with one we also train the call: the tokens only
    we train are exactly the call's region (Llama 3.1: the JSON and its <|eot_id|>; Qwen3: from
    the end of the reasoning, '</think>' included only with train_on_reasoning, through
    '<|im_end|>\\n'), none without last_turn_only; the weights of the tokens both train are then
    proportional (our mean includes the call). And with train_on_reasoning=False pgs still trains
    the newline after the reasoning of that answerless turn (the Qwen3 tool-call turn); we do not,
    as the newline belongs to the '</think>\\n\\n' we leave out."""
    tok = tokenizer(name)
    ours = encode({"messages": chat}, tok, opts(**options))
    theirs = pgs_chat_dataset(None, tok, 4096, **options)._process({"messages": chat})
    assert ours.ids.tolist() == theirs["input_ids"].tolist()
    trained, pgs_trained = ours.weights > 0, (theirs["labels"] != -100).numpy()
    weights = theirs["loss_weights"].numpy() if "loss_weights" in theirs else None
    calls = any(m.get("tool_calls") for m in chat)
    if options.get("train_on_reasoning") is False and chat is QWEN_TOOL_CHAT:
        extra = np.flatnonzero(pgs_trained & ~trained)
        assert tok.decode(ours.ids[extra].tolist()) == "\n" and len(extra) == 1
        assert "I should call the tool" in tok.decode(ours.ids[:extra[0]].tolist())[-30:]
        pgs_trained[extra] = False
    assert not (pgs_trained & ~trained).any()
    only_ours = np.flatnonzero(trained & ~pgs_trained)
    if not calls or options.get("last_turn_only"):
        assert only_ours.size == 0
        if weights is not None:
            np.testing.assert_allclose(ours.weights, weights, rtol=1e-6)
        return
    assert np.all(np.diff(only_ours) == 1)
    thought = "</think>\n\n" if options.get("train_on_reasoning", True) else ""
    assert tok.decode(ours.ids[only_ours].tolist()) == (
        LLAMA_CALL + "<|eot_id|>" if name == "llama31" else thought + QWEN_CALL + "<|im_end|>\n")
    if weights is not None:
        common = trained & pgs_trained
        np.testing.assert_allclose(ours.weights[common] / weights[common],
                                   ours.weights[common][0] / weights[common][0], rtol=1e-6)
