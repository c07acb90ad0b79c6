"""A checkpoint's chat template: where it is read from, how it is rendered, which family it is.

Where: ``chat_template.jinja`` in the tokenizer's directory, else ``chat_template`` in its
``tokenizer_config.json`` (a string, or Hugging Face's list of ``{"name", "template"}``, of which
"default" is used). The file wins over the config entry, as in transformers.

How: jinja2's ``ImmutableSandboxedEnvironment`` set up as Hugging Face tokenizers set theirs up
(``trim_blocks``, ``lstrip_blocks``, loop controls, a pass-through ``{% generation %}`` block, the
globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not escape HTML), with
the variables transformers passes: ``messages``, ``tools``, ``documents`` (None),
``add_generation_prompt``, ``enable_thinking`` only when given, and the named special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...; strings
or AddedToken objects with ``"content"``). Message keys whose value is None are dropped and
``reasoning_content`` / ``thinking`` / ``reasoning`` are aliased to each other first, as transformers
does, so the same messages render to the same text.

Which family: :data:`FAMILIES`, keyed by name, says how a rendered conversation marks an assistant
turn (for the training loss mask), what system prompt DeepSpec's parser prepends and what text it
puts before every assistant answer and leaves out of the loss. A template is of the first family
whose ``marker`` it contains. Two rows, as DeepSpec's parser has them: ``qwen`` (ChatML turns, the
system prompt "You are a helpful assistant.", no prefix) and ``gemma4`` (``<|turn>`` turns, the
assistant's role named ``model``, no system prompt, the empty thought channel as prefix).

:data:`CHATML_TEMPLATE` is the fallback for checkpoints without a template; :data:`TINY_CHAT_TEMPLATE`
is the Qwen3-style template the tiny test/demo tokenizer ships (no ``<think>`` blocks at all, since
the tiny vocabulary has no think tokens: ``enable_thinking`` and ``reasoning_content`` are ignored).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.generation_config import read_json_object

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens transformers hands to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class TemplateFamily:
    """How one family of chat templates lays out a conversation (see the module docstring)."""

    name: str
    marker: str  # a template containing this string is of the family
    assistant_start: str  # opens an assistant turn in the rendered text
    turn_end: str  # closes a turn, its trailing newline included
    default_system_prompt: str | None  # prepended to training conversations without their own
    # Put before every assistant text of a training conversation that does not start with it, and
    # left out of the loss where it opens an assistant turn ("": none).
    assistant_loss_prefix: str


FAMILIES: dict[str, TemplateFamily] = {
    "qwen": TemplateFamily(
        name="qwen",
        marker="<|im_start|>",
        assistant_start="<|im_start|>assistant\n",
        turn_end="<|im_end|>\n",
        default_system_prompt="You are a helpful assistant.",
        assistant_loss_prefix="",
    ),
    "gemma4": TemplateFamily(
        name="gemma4",
        marker="<|turn>",
        assistant_start="<|turn>model\n",
        turn_end="<turn|>\n",
        default_system_prompt=None,
        # The empty thought channel: the answer of a turn with thinking off.
        assistant_loss_prefix="<|channel>thought\n<channel|>",
    ),
}


def template_family(source: str) -> TemplateFamily | None:
    """The first family of :data:`FAMILIES` whose marker ``source`` contains, or None."""
    return next((f for f in FAMILIES.values() if f.marker in source), None)


# The hand-written ChatML layout used when a checkpoint has no template of its own.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + ((call.function or call) | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's layout (system and tools block, tool calls, tool responses folded into user turns) minus
# its think blocks. Written for the tiny tokenizer of the tests and the demo pair.
TINY_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunction signatures, one JSON object per line:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall a function with <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function else call %}
{%- if loop.first and content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}
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
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


class _TemplateRaised(jinja2.TemplateError):
    """A template's own ``raise_exception(...)``."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers in some templates): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages as transformers hands them to a template (None values dropped, reasoning aliased)."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. ``origin`` names where it came from (a file, or the built-in layout)."""

    source: str
    origin: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    builtin: bool = False
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise CheckpointError(
                f"{self.origin}: chat template does not parse (template line {err.lineno}: {err.message})"
            ) from err
        object.__setattr__(self, "_compiled", compiled)

    @property
    def family(self) -> TemplateFamily | None:
        """The template's family (None when no row of :data:`FAMILIES` matches)."""
        return template_family(self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        where: str = "",
    ) -> str:
        """The text of ``messages``; ``enable_thinking`` is passed only when not None.

        A template that fails (its ``raise_exception`` or any other error) raises DataError naming
        ``where`` (the record's file:line) and the template's origin.
        """
        variables: dict[str, Any] = {
            **self.special_tokens,
            "messages": _template_messages(messages),
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._compiled.render(**variables)
        except _TemplateRaised as err:
            problem = f"chat template {self.origin} refused the conversation: {err.message}"
        except Exception as err:  # noqa: BLE001 (a template can fail with any Python error)
            problem = f"chat template {self.origin} failed to render: {type(err).__name__}: {err}"
        raise DataError(f"{where}: {problem}" if where else problem)


def builtin_chatml() -> ChatTemplate:
    """The fallback ChatML layout, as a template."""
    return ChatTemplate(CHATML_TEMPLATE, origin="built-in ChatML", builtin=True)


def _special_tokens(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
            if not isinstance(value, str):
                raise CheckpointError(f"{path}: '{key}' is an object without a string 'content'")
        if value is None:
            continue
        if not isinstance(value, str):
            raise CheckpointError(f"{path}: '{key}' must be a string or an object with 'content', got {value!r}")
        tokens[key] = value
    return tokens


def _config_template(value: Any, path: Path) -> str:
    """The template string of a ``chat_template`` entry (a string or a list of named templates)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise CheckpointError(f"{path}: 'chat_template' entry {i} must be {{\"name\": str, \"template\": str}}")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise CheckpointError(f"{path}: 'chat_template' has no template named 'default' (has {sorted(named)})")
        return named["default"]
    raise CheckpointError(
        f"{path}: 'chat_template' must be a string or a list of {{name, template}}, got {type(value).__name__}"
    )


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The template of a tokenizer directory (see the module docstring), or None when it has none."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    config = read_json_object(config_path) or {}
    special = _special_tokens(config, config_path)
    jinja_path = directory / TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{jinja_path}: cannot read chat template ({err})") from err
        return ChatTemplate(source, origin=str(jinja_path), special_tokens=special)
    if config.get("chat_template") is None:
        return None
    source = _config_template(config["chat_template"], config_path)
    return ChatTemplate(source, origin=f"{config_path} ('chat_template')", special_tokens=special)
