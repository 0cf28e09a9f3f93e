"""Where an assistant turn's loss-mask span starts and ends, on templates whose rendering makes
that hard: a generation prompt that opens a think block (Qwen3.5/3.6), turns cut at generation
while thinking, a template that closes the whole chat with EOS (Phi-3), and tool calls."""

from __future__ import annotations

import json

import datasets
import pytest

from layertap.extract.inputs import (
    BAD_MESSAGE, TEMPLATE_ERROR, Skipped, TokenizedSample, TokenizeStats, normalize_chat, tokenize_rows,
)
from test_inputs import _runs
from tiny_models import CHATML_TEMPLATE, QWEN3_TEMPLATE, QWEN35_TEMPLATE, tiny_tokenizer

# Phi-3 mini/small/medium/3.5: a chat that ends without a generation prompt ends with EOS.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def _sample(messages, tokenizer, finish_reasons=None) -> TokenizedSample:
    row = {"id": "r", "messages": messages}
    if finish_reasons is not None:  # as `layertap regenerate` writes it
        row["regenerated"] = {"row": 0, "completion_tokens": 50, "finish_reasons": finish_reasons}
    (out,) = tokenize_rows(datasets.Dataset.from_list([row]), tokenizer, 4096)
    assert isinstance(out, TokenizedSample), out
    return out


def _chat(first_answer: str, last_answer: str = "ok sure") -> list[dict]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": "the user's second message"},
            {"role": "assistant", "content": last_answer}]


@pytest.mark.parametrize("empty", ["", "   ", "\n"])
def test_an_empty_earlier_turn_supervises_its_end_of_turn_not_the_next_user_turn(empty):
    """Qwen3.5/3.6: the generation prompt's ``<think>`` agrees with the ``<`` of an empty turn's
    ``<|im_end|>``; the span started past it and ran on to the next user turn's end."""
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    assert _runs(_sample(_chat(empty), tok), tok) == ["<|im_end|>", "</think>\n\nok sure<|im_end|>"]


@pytest.mark.parametrize("answer", ["<b>bold</b> text here", "<think>done</think> ok then",
                                    "<table><tr></tr></table> done"])
def test_an_earlier_turn_that_starts_like_the_think_block_keeps_its_first_token(answer):
    """Qwen3.5/3.6: an answer starting with ``<`` (HTML, XML) lost its first token(s) from the mask."""
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    assert _runs(_sample(_chat(answer), tok), tok)[0] == answer + "<|im_end|>"


REASONING = "Let me think about the fox. The quick brown fox jumps over the lazy dog and then"


@pytest.mark.parametrize("template, generated", [(QWEN3_TEMPLATE, "<think>\n" + REASONING),
                                                 (QWEN35_TEMPLATE, REASONING)],  # its prompt holds <think>\n
                         ids=["qwen3", "qwen3.5"])
def test_a_turn_cut_while_thinking_is_supervised_up_to_its_last_reasoning_token(template, generated):
    """Cut at --max-tokens before any answer (content "", finish reason "length"): what the target
    generated is its reasoning; the think block's close and the end of turn are the template's."""
    tok = tiny_tokenizer(template)
    messages = _chat("Hello there friend", "")
    messages[-1]["reasoning_content"] = REASONING
    assert _runs(_sample(messages, tok, ["stop", "length"]), tok) == ["Hello there friend<|im_end|>", generated]


def test_a_single_turn_row_cut_while_thinking_is_kept():
    """It was skipped as no_supervised_pair: its one turn had an empty span."""
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    messages = [{"role": "user", "content": "Explain the fox"},
                {"role": "assistant", "content": "", "reasoning_content": REASONING}]
    assert _runs(_sample(messages, tok, ["length"]), tok) == [REASONING]


def test_a_cut_turn_ends_at_its_content_not_where_the_content_first_occurs_in_its_reasoning():
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    reasoning = "The user asks about the fox. The answer is that the quick brown fox jumps over the lazy dog."
    messages = [{"role": "user", "content": "What does the fox do?"},
                {"role": "assistant", "content": "The answer is", "reasoning_content": reasoning}]
    assert _runs(_sample(messages, tok, ["length"]), tok) == [reasoning + "\n</think>\n\nThe answer is"]


def test_a_template_that_closes_the_chat_with_eos_is_masked_per_turn():
    """Phi-3 writes EOS where a generation prompt would go: every row was skipped as template_error
    (a rendered prefix of the chat is then no prefix of it) and the end of turn probed as
    ``<|end|>\\n`` + EOS, which only the last turn has."""
    tok = tiny_tokenizer(PHI3_TEMPLATE)
    messages = _chat("Hello there", "The fox jumps")
    assert _runs(_sample(messages, tok), tok) == ["Hello there<|end|>", "The fox jumps<|end|>"]
    # A template whose user turn ends with EOS keeps it: only a chat's trailer is set apart.
    tok = tiny_tokenizer(CHATML_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>"))
    assert _runs(_sample(messages, tok), tok) == ["Hello there<|im_end|>", "The fox jumps<|im_end|>"]


# --- tool calls ---------------------------------------------------------------------------------

# Modeled on Qwen3's template: tools listed in the system turn, tool calls after the assistant's
# content, tool results in a user turn, a think block on the turns after the last user query
# (kept on earlier ones only when they have reasoning), and reasoning inline in the content
# (``<think>...</think>answer``) taken out of it.
QWEN3_TOOLS_TEMPLATE = """
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
  {{- '# Tools\n\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
  {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- set content = m.content if m.content is string else '' %}
  {%- if m.role == 'user' %}
    {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
    {%- if '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
      {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
    {%- endif %}
    {{- content }}
    {%- for call in m.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
      {%- set call = call.function or call %}
      {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
      {{- call.arguments if call.arguments is string else call.arguments | tojson }}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
# Qwen3.5/3.6: the generation prompt opens the think block.
QWEN36_TOOLS_TEMPLATE = QWEN3_TOOLS_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}")
assert QWEN36_TOOLS_TEMPLATE != QWEN3_TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RENDERED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _tool_chat(first_content=None) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": first_content, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
            {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."}]


@pytest.mark.parametrize("template, last_turn", [
    (QWEN3_TOOLS_TEMPLATE, "<think>\n\n</think>\n\nIt is 18 degrees and sunny in Paris.<|im_end|>"),
    # the prompt ends inside a token ("\n\n" after <think>): that token is left out
    (QWEN36_TOOLS_TEMPLATE, "</think>\n\nIt is 18 degrees and sunny in Paris.<|im_end|>")],
    ids=["qwen3", "qwen3.6"])
@pytest.mark.parametrize("first_content", [None, "", "Let me check."])
def test_tool_calls_are_supervised_and_tool_results_are_not(template, last_turn, first_content):
    """The rendered tool call is what the target generates (with Qwen3.6's ``<think>\\n`` prompt
    its first ``<`` is kept); the tool's result, the tools and the system turn are not."""
    tok = tiny_tokenizer(template)
    row = {"id": "t", "messages": _tool_chat(first_content), "tools": [WEATHER]}
    (s,) = tokenize_rows([row], tok, 4096)
    assert isinstance(s, TokenizedSample), s
    call = (first_content + "\n" if first_content else "") + RENDERED_CALL + "<|im_end|>"
    assert _runs(s, tok) == [call, last_turn]
    text = tok.decode(s.input_ids)
    assert '"name": "get_weather", "description"' in text and "<tool_response>\n18 degrees" in text


def test_tools_as_json_and_tools_unified_by_datasets_render_as_given():
    """``datasets`` gives every row's tool schemas the fields of all rows' (null where a row has
    none); a template would write them out. A JSON string of the tools keeps them as written."""
    tok = tiny_tokenizer(QWEN3_TOOLS_TEMPLATE)
    other = {"type": "function", "function": {"name": "add", "description": "Sum.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
    rows = [{"id": "t", "messages": _tool_chat(), "tools": [WEATHER]},
            {"id": "u", "messages": _tool_chat(), "tools": [other]}]
    expected = [tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False) for r in rows]
    for given in (datasets.Dataset.from_list(rows),
                  datasets.Dataset.from_list([{**r, "tools": json.dumps(r["tools"])} for r in rows])):
        assert [tok.decode(s.input_ids) for s in tokenize_rows(given, tok, 4096)] == expected


def test_tool_rows_are_refused_where_they_are_not_extracted():
    """Regeneration answers each assistant turn anew: a new tool call would not be the one the
    recorded tool result answers, so normalize_chat refuses tool rows unless asked."""
    for messages in (_tool_chat(), _tool_chat("Let me check.")):
        out = normalize_chat(messages, "t", TokenizeStats(), require_assistant=False)
        assert isinstance(out, Skipped) and out.reason == BAD_MESSAGE, out
    messages = normalize_chat(_tool_chat(), "t", TokenizeStats(), extracting=True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == "" and messages[2]["tool_calls"] == [CALL]


def test_reasoning_inline_in_the_last_turn_is_supervised():
    """A template that takes ``<think>...</think>`` out of the content renders the sentinel differently
    from the content: the content is then searched for, as before."""
    tok = tiny_tokenizer(QWEN3_TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>two and two</think>4"}]
    assert _runs(_sample(messages, tok), tok) == ["<think>\ntwo and two\n</think>\n\n4<|im_end|>"]


def test_tool_calls_under_a_template_that_does_not_write_them_are_skipped():
    """The turn would render empty: its call neither seen by the target nor trained."""
    (s,) = tokenize_rows([{"messages": _tool_chat("Let me check.")}], tiny_tokenizer(CHATML_TEMPLATE), 4096)
    assert isinstance(s, Skipped) and s.reason == TEMPLATE_ERROR and "tool_calls" in s.detail


def test_an_assistant_turn_of_weight_0_is_context_only():
    """ShareGPT datasets mark a turn kept as context only with ``weight: 0``: it was trained on."""
    tok = tiny_tokenizer(CHATML_TEMPLATE)
    row = {"id": "w", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "a refusal", "weight": 0},
        {"from": "human", "value": "again"}, {"from": "gpt", "value": "a good answer", "weight": 1}]}
    (out,) = tokenize_rows(datasets.Dataset.from_list([row]), tok, 4096)
    assert _runs(out, tok) == ["a good answer<|im_end|>"]
    assert "a refusal" in tok.decode(out.input_ids)  # still rendered: the context the next turn answers
    row["conversations"][3]["weight"] = 0
    (out,) = tokenize_rows(datasets.Dataset.from_list([row]), tok, 4096)
    assert isinstance(out, Skipped) and out.reason == "no_supervised_pair", out
    row["conversations"][3]["weight"] = 0.5
    (out,) = tokenize_rows(datasets.Dataset.from_list([row]), tok, 4096)
    assert isinstance(out, Skipped) and out.reason == "bad_message" and "message 3 has weight 0.5" in out.detail
    # eval's prompts and regenerate's rows have no use for weights: not checked there
    assert not isinstance(normalize_chat(row["conversations"], "w", TokenizeStats()), Skipped)


def test_a_blank_tools_string_is_a_plain_chat():
    """A string `tools` column holds "" in its plain chat rows: they were skipped as bad JSON."""
    tok = tiny_tokenizer(CHATML_TEMPLATE)
    row = {"id": "t", "tools": "  ", "messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]}
    (out,) = tokenize_rows(datasets.Dataset.from_list([row]), tok, 4096)
    assert isinstance(out, TokenizedSample) and _runs(out, tok) == ["hello<|im_end|>"], out


# GPT-OSS (harmony), its turn structure: an earlier assistant turn ends with <|end|>, the last
# (no generation prompt after it) with <|return|>.
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|return|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- else -%}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def test_a_template_that_ends_earlier_turns_otherwise_than_the_last_supervises_each_end():
    """The end of turn was probed on a last turn only (<|return|>): from an earlier turn, the search
    found the chat's end, and every multi-turn GPT-OSS row was refused as a template mismatch; a
    turn followed by a user turn alone lost its end-of-turn label."""
    tok = tiny_tokenizer(HARMONY_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                          "<|return|>"]})
    header = "<|channel|>final<|message|>"
    assert _runs(_sample(_chat("Hello there friend"), tok), tok) == [header + "Hello there friend<|end|>",
                                                                     header + "ok sure<|return|>"]
    assert _runs(_sample(_chat("Hello there friend")[:3], tok), tok) == [header + "Hello there friend<|end|>"]
    assert _runs(_sample(_chat("Hello there friend")[:2], tok), tok) == [header + "Hello there friend<|return|>"]
    # ChatML ends every turn alike: no second marker
    from layertap.extract.inputs import _ChatRenderer

    assert _ChatRenderer(tiny_tokenizer(), None).end_of_earlier_turn is None
    assert _ChatRenderer(tok, None).end_of_earlier_turn == "<|end|>"


# GLM-4's shape: nothing after an assistant's content (the next header, <|user|> or <|observation|>, ends it)
GLM4_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}{% if m.role=='tool' %}<|observation|>\n{{ m.content }}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_template_that_writes_no_end_of_turn_takes_no_next_header_for_one():
    """GLM writes nothing after a turn's content (EOS stands in for its end of turn): the earlier-turn
    probe took the next turn's <|user|> for an earlier turn's end, which put it in that turn's span, and a
    turn before a tool result ran on past the next turn (the row refused as a template mismatch)."""
    from layertap.extract.inputs import _ChatRenderer

    tok = tiny_tokenizer(GLM4_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>",
                                                          "<|observation|>", "<|system|>"]})
    assert _ChatRenderer(tok, None).end_of_earlier_turn is None
    assert _runs(_sample(_chat("Hello there friend"), tok), tok) == ["Hello there friend", "ok sure"]
    tool = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there friend"},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok sure"}]
    assert _runs(_sample(tool, tok), tok) == ["Hello there friend", "ok sure"]
