"""The built-in tiny model (``model: builtin:tiny``): built locally, no download, any machine.

A character-level tokenizer (printable ASCII, newline, tab, the chat markers and tool-call tags) and a
randomly initialised two-layer Llama with untied input/output embeddings (``builtin:tiny-qwen`` is the
tied one). head_dim is 64 because vLLM's CPU attention kernels refuse 16.
"""

from __future__ import annotations

from pathlib import Path

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PAD, UNK = "<|pad|>", "<|unk|>"

# Qwen-style ChatML with tools. Tool calls are rendered as <tool_call>{json}</tool_call> after the
# assistant's text; the server parses the same form back out of the model's output. transformers renders
# templates with trim_blocks, which eats a newline written right after a block tag: such newlines are
# written as {{ '\n' }}.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    'Call a tool with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocabulary() -> dict[str, int]:
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    tokens = [PAD, UNK, EOT, IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE, *chars]
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocabulary()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=None,
        additional_special_tokens=[EOT, IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([TOOL_OPEN, TOOL_CLOSE])  # whole tokens, kept in decoded text
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    return tokenizer


def build_model(vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=_vocabulary()[IM_END],
        pad_token_id=_vocabulary()[PAD],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [_vocabulary()[IM_END], _vocabulary()[EOT]]
    return model


def save_tiny_model(folder: Path, seed: int = 0) -> None:
    """Write tokenizer + model into ``folder`` (a folder vLLM, transformers and DeepSpeed load as a model
    path). ``model_path.resolve_model`` calls it on a temporary folder that it then renames."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    build_model(len(tokenizer), seed).save_pretrained(folder, safe_serialization=True)
