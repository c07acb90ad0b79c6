"""A Qwen3-style tokenizer directory for the chat-template tests: a tiny byte-level BPE with Qwen3's
chat specials, and a template written here after Qwen3's behaviour (system prompt, tools block,
tool calls, tool responses folded into user turns, reasoning_content, think blocks after the last
user query, and an empty think block closing the generation prompt when enable_thinking is false)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "You are a helpful assistant. What is the weather like in Paris today?",
    "It is sunny, 21 degrees. The function get_weather returns a JSON object.",
    "Count from 1 to 9: 1 2 3 4 5 6 7 8 9. Thinking step by step, the answer is four.",
    'user assistant system tool {"name": "get_weather", "arguments": {"city": "Paris"}}',
]

QWEN3_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou can call these functions:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nReply to call one with <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{#- The last real user query: think blocks are kept only for the assistant turns after it. #}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' and not (message.content.startswith('<tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function else call %}
            {%- if not loop.first or content %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def make_qwen3_style_dir(out: Path, *, template: str | None = QWEN3_STYLE_TEMPLATE, form: str = "config",
                         config: dict | None = None) -> Path:
    """Writes tokenizer.json and tokenizer_config.json into ``out``; ``form`` puts the template in the
    config as a string ("config"), as Hugging Face's named list ("list"), or in chat_template.jinja ("jinja")."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 3, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", **(config or {})}
    if template is not None:
        if form == "config":
            cfg["chat_template"] = template
        elif form == "list":
            cfg["chat_template"] = [{"name": "rag", "template": "unused"},
                                    {"name": "default", "template": template}]
        else:
            (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return out
