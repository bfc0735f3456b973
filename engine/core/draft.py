"""``--speculative-config`` method ``draft_model``: the draft's folder and config, checked
against the served model's before its weights load, and the proposer over its own runner and
KV cache."""

from __future__ import annotations

import logging

import torch

from llmrpc.engine.loading import loader
from llmrpc.engine.pooling.params import is_encoder
from llmrpc.engine.runner.model_runner import ModelRunner, kv_bytes_per_block
from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.engine.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft named by ``speculative.model``; ``model``: its weights, loaded by the engine."""

    def __init__(self, speculative: SpeculativeConfig, target_tokenizer) -> None:
        self.speculative = speculative
        self.model_dir = loader.resolve_model_dir(speculative.model)
        self.hf_config = loader.load_hf_config(self.model_dir)
        self.model = None
        if is_encoder(getattr(self.hf_config, "architectures", None)):
            raise ValueError(
                f"--speculative-config model {speculative.model!r} is an encoder; a draft "
                "generates tokens"
            )
        check_same_tokenizer(speculative.model, self.model_dir, target_tokenizer)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.hf_config, block_size, dtype)

    def max_model_len(self, target_max_model_len: int) -> int:
        positions = getattr(self.hf_config, "max_position_embeddings", None)
        return min(target_max_model_len, positions or target_max_model_len)

    def proposer(
        self,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        attention_backend: str,
        max_model_len: int,
        vocab_size: int,
        max_num_tokens: int,
    ) -> DraftModelProposer:
        runner = ModelRunner(
            self.model, self.hf_config, num_blocks, block_size, kv_cache_dtype, attention_backend
        )
        logger.info(
            "speculative decoding: draft model %s, %d draft tokens; its KV cache %d blocks "
            "(%.2f GiB at most)",
            self.model_dir,
            self.speculative.num_speculative_tokens,
            num_blocks,
            runner.kv_cache_bytes / 2**30,
        )
        return DraftModelProposer(
            self.speculative,
            runner,
            KVCacheManager(num_blocks, block_size, enable_caching=False),
            self.max_model_len(max_model_len),
            vocab_size,
            max_num_tokens,
        )


def check_same_tokenizer(name: str, draft_dir, target_tokenizer) -> None:
    """A draft proposes token ids, which mean the same only under the same vocabulary: the
    draft's tokenizer must map every token to the id the target's does."""
    try:
        draft_tokenizer = loader.load_tokenizer(draft_dir)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--speculative-config model {name!r}: its tokenizer could not be loaded to check "
            f"it against the served model's ({error})"
        ) from error
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab == target_vocab:
        return
    differ = sorted(
        token for token in draft_vocab.keys() | target_vocab.keys()
        if draft_vocab.get(token) != target_vocab.get(token)
    )  # fmt: skip
    raise ValueError(
        f"--speculative-config model {name!r} has another tokenizer than the served model: "
        f"{len(differ)} token(s) differ (such as {differ[0]!r}: "
        f"{draft_vocab.get(differ[0])} in the draft, {target_vocab.get(differ[0])} served); a "
        "draft must share the served model's tokenizer"
    )
