"""Prompt data: the project's character tokenizer, the shipped arithmetic task, the prompt encoder
(tokenizer section, chat templates, EOS ids), prompt datasets (JSONL / Parquet, plain or chat
prompts) with resumable shuffling, and SFT warm-start batches.

transformers is imported only when a tokenizer is loaded; pandas/pyarrow only for Parquet files.
"""

from megatron_rl_fp8.data.arithmetic import (
    DEFAULT_TRAIN_PATH,
    DEFAULT_VAL_PATH,
    generate_splits,
    write_task_files,
)
from megatron_rl_fp8.data.dataset import DataError, PromptDataset, get_dotted, load_records
from megatron_rl_fp8.data.prompts import PromptEncoder, TokenizerConfig, load_prompt_encoder
from megatron_rl_fp8.data.sft import (
    SFTExample,
    collate,
    sft_example,
    sft_examples,
    sft_examples_from_records,
)
from megatron_rl_fp8.data.task import TaskConfig, build_datasets
from megatron_rl_fp8.data.tokenizer import (
    BOS_ID,
    BOS_TOKEN,
    DEFAULT_TOKENIZER_DIR,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    UNK_ID,
    UNK_TOKEN,
    VOCAB,
    VOCAB_SIZE,
    build_tokenizer,
    encode_text,
    load_tokenizer,
    prompt_token_ids,
    write_tokenizer_files,
)

__all__ = [
    "BOS_ID",
    "BOS_TOKEN",
    "DEFAULT_TOKENIZER_DIR",
    "DEFAULT_TRAIN_PATH",
    "DEFAULT_VAL_PATH",
    "EOS_ID",
    "EOS_TOKEN",
    "PAD_ID",
    "PAD_TOKEN",
    "UNK_ID",
    "UNK_TOKEN",
    "VOCAB",
    "VOCAB_SIZE",
    "DataError",
    "PromptDataset",
    "PromptEncoder",
    "SFTExample",
    "TaskConfig",
    "TokenizerConfig",
    "build_datasets",
    "build_tokenizer",
    "collate",
    "encode_text",
    "generate_splits",
    "get_dotted",
    "load_prompt_encoder",
    "load_records",
    "load_tokenizer",
    "prompt_token_ids",
    "sft_example",
    "sft_examples",
    "sft_examples_from_records",
    "write_task_files",
    "write_tokenizer_files",
]
