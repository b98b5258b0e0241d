"""The lm-evaluation-harness model ``satlab``: any satlab checkpoint or in-memory model behind lm-eval's interface.

``lm_eval.simple_evaluate(model="satlab", model_args="ckpt=runs/default", ...)`` once this module is imported, or
``SatlabLM(model=model, tokenizer=tokenizer)`` for a model in memory. lm-eval does the prompting and scoring;
this class only turns token ids into log-probabilities and generations:

* ``loglikelihood``: lm-eval's ``TemplateLM`` tokenizes (moving trailing context spaces into the continuation);
  here each context + continuation is cut from the left to ``max_seq_len + 1`` tokens and scored in batches sorted
  by length and padded on the right, which a causal model never attends to. The choices of a multiple-choice
  item share one pass over their context through the KV cache, which makes long retrieval items ~4x cheaper.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_seq_len`` tokens, each conditioned on
  the end-of-text token or on the window before, scored as loglikelihood requests.
* ``generate_until``: the model's KV-cached ``generate``, cut at the first stop string.

The vocabulary projection runs only at the positions that are scored (``DecoderLM.forward``'s ``select``), and the
seconds spent on each task's requests add up in ``task_seconds`` (a batch's time split over its requests).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from satlab.config.errors import ConfigError
from satlab.data.tokenizer import TextTokenizer
from satlab.models import DecoderLM
from satlab.training.checkpoint import load_checkpoint

DEFAULT_BATCH_SIZE = 32
LOGITS_BUDGET = 2**26
"""Logit floats per forward pass (256 MB): the default token budget of a batch is this over the vocabulary size."""
FIRST_GENERATION_CHUNK = 16


@register_model("satlab")
class SatlabLM(TemplateLM):
    """A satlab model for lm-eval: give ``ckpt`` (a checkpoint file or run directory) or ``model`` + ``tokenizer``.

    ``batch_size`` caps the sequences per forward pass and ``max_batch_tokens`` their padded tokens (default:
    LOGITS_BUDGET / vocabulary size), so memory stays flat from short cloze items to full-length windows.
    ``max_gen_toks`` is the generation length for tasks that do not set one. ``max_batch_size`` is accepted
    because lm-eval passes it to every model, and unused.
    """

    def __init__(self, ckpt: str | Path | None = None, model: DecoderLM | None = None,
                 tokenizer: TextTokenizer | None = None, device: str | None = None,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, max_batch_tokens: int | str | None = None,
                 max_gen_toks: int | str = 256, max_batch_size: int | None = None) -> None:
        super().__init__()
        if (ckpt is None) == (model is None) or (model is not None and tokenizer is None):
            raise ConfigError("the satlab lm-eval model needs either ckpt=<checkpoint file or run directory> or "
                              "an in-memory model together with its tokenizer, not both and not neither.")
        self.step, self.ckpt_path = None, None
        if ckpt is not None:
            loaded = load_checkpoint(ckpt, device or "cpu")
            model, tokenizer, self.step, self.ckpt_path = loaded.model, loaded.tokenizer, loaded.step, loaded.path
        elif device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = next(model.parameters()).device
        auto = batch_size is None or str(batch_size).startswith("auto")  # lm-eval's "auto" / "auto:N"
        self.batch_size = DEFAULT_BATCH_SIZE if auto else int(batch_size)
        vocab = model.cfg.vocab_size
        self.max_batch_tokens = int(max_batch_tokens) if max_batch_tokens else max(LOGITS_BUDGET // vocab, 1)
        self.max_gen_toks = int(max_gen_toks)
        self.task_seconds: dict[str, float] = defaultdict(float)
        self._request_tasks: list[str | None] | None = None

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.fingerprint

    def get_model_info(self) -> dict:
        return {"satlab_arch": self.model.cfg.arch, "satlab_ckpt": str(self.ckpt_path), "satlab_step": self.step}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._request_tasks = [req.task_name for req in requests]  # TemplateLM keeps the order of the requests
        return super().loglikelihood(requests, disable_tqdm)

    def _timed(self, tasks: list[str | None], started: float) -> None:
        share = (time.perf_counter() - started) / max(len(tasks), 1)
        for task in tasks:
            self.task_seconds[task or "unnamed"] += share

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, tasks: list[str | None] | None = None,
                              **kwargs) -> list[tuple[float, bool]]:
        """(sum of continuation log-probabilities, whether greedy decoding yields the continuation) per request.

        Requests that share their context tokens and need no truncation (the choices of a multiple-choice item)
        run the context once and their continuations together on copies of its KV cache; the others are scored
        in length-sorted batches. Either way the logits are those of one forward pass over context + continuation.
        """
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit in the model's "
                                 f"{self.max_length}-token context")
            fits = len(continuation) > 0 and len(context) + len(continuation) - 1 <= self.max_length
            groups.setdefault(tuple(context) if fits else (-1 - i,), []).append(i)
        alone = [idxs[0] for idxs in groups.values() if len(idxs) == 1]
        jobs = [("batch", b) for b in self._batches(alone, [len(r[1]) + len(r[2]) for r in requests])]
        jobs += [("shared", idxs) for idxs in groups.values() if len(idxs) > 1]
        tasks, self._request_tasks = tasks or self._request_tasks or [None] * len(requests), None
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for kind, idxs in tqdm(jobs, disable=disable_tqdm, desc="satlab loglikelihood"):
            started = time.perf_counter()
            scores = self._score_batch if kind == "batch" else self._score_shared
            for i, result in zip(idxs, scores([requests[i][1:] for i in idxs]), strict=True):
                results[i] = result
            self._timed([tasks[i] for i in idxs], started)
        for request, result in zip(requests, results, strict=True):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        return results

    def _batches(self, indices: list[int], lengths: list[int]) -> Iterator[list[int]]:
        """``indices`` grouped longest first, each group within ``batch_size`` rows and ``max_batch_tokens`` padded
        tokens (lm-eval's Collator counts rows only, which would let long windows blow up the logits)."""
        batch: list[int] = []
        for i in sorted(indices, key=lambda i: -lengths[i]):
            if batch and (len(batch) == self.batch_size
                          or (len(batch) + 1) * min(lengths[batch[0]], self.max_length) > self.max_batch_tokens):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Context + continuation cut from the left to ``max_seq_len + 1`` tokens, padded on the right (a causal
        model never attends to the padding), one forward pass for all."""
        windows = [(context + continuation)[-(self.max_length + 1):] for context, continuation in pairs]
        ids = torch.full((len(windows), max(len(w) for w in windows) - 1), self.eot_token_id, dtype=torch.long)
        scored = torch.zeros(ids.shape, dtype=torch.bool)  # the positions whose next token is a continuation's
        for row, (window, (_, continuation)) in enumerate(zip(windows, pairs, strict=True)):
            ids[row, : len(window) - 1] = torch.tensor(window[:-1])
            scored[row, len(window) - 1 - len(continuation) : len(window) - 1] = True
        logits = self.model(ids.to(self.device), select=scored.to(self.device)).logits
        rows = logits.split([len(c) for _, c in pairs])
        return [self._score(row, c) if c else (0.0, True) for row, (_, c) in zip(rows, pairs, strict=True)]

    def _score_shared(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Continuations of one context: the context runs once into a KV cache, which is then copied for each
        continuation (through LayerKVCache's ``k``/``v`` tensors, the only state a satlab model keeps across
        positions) so all continuations but their first tokens run as one batch."""
        context, continuations = pairs[0][0], [c for _, c in pairs]
        width = max(len(c) for c in continuations) - 1
        cache = self.model.new_cache(1, len(context) + width)
        last_position = torch.zeros((1, len(context)), dtype=torch.bool, device=self.device)
        last_position[0, -1] = True
        last = self.model(torch.tensor([context], device=self.device), cache=cache, select=last_position).logits
        if not width:
            return [self._score(last, c) for c in continuations]
        for layer in cache.layers:
            layer.k, layer.v = layer.k.repeat(len(pairs), 1, 1, 1), layer.v.repeat(len(pairs), 1, 1, 1)
        ids = torch.full((len(pairs), width), self.eot_token_id, dtype=torch.long)
        scored = torch.zeros(ids.shape, dtype=torch.bool)
        for row, continuation in enumerate(continuations):
            ids[row, : len(continuation) - 1] = torch.tensor(continuation[:-1])
            scored[row, : len(continuation) - 1] = True
        rest = self.model(ids.to(self.device), cache=cache, select=scored.to(self.device)).logits
        rows = rest.split([len(c) - 1 for c in continuations])
        return [self._score(torch.cat([last, row]), c) for row, c in zip(rows, continuations, strict=True)]

    def _score(self, logits: torch.Tensor, target: list[int]) -> tuple[float, bool]:
        """Sum of log-probabilities of ``target`` under ``logits`` (one row per target token) and greediness."""
        logprobs = logits.float().log_softmax(-1)
        ids = torch.tensor(target, device=logprobs.device)
        return logprobs.gather(-1, ids[:, None]).sum().item(), bool((logprobs.argmax(-1) == ids).all())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts over lm-eval's disjoint rolling windows, all requests batched together."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for window in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        tasks = [requests[owner].task_name for owner in owners]
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm, tasks), strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample``) continuations cut before the first stop string; prompts of equal
        token length and settings are generated together, as the model takes no padding mask."""
        eos_text = self.tok_decode([self.eot_token_id])
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks)
            until = tuple(handle_stop_sequences(kwargs["until"], eos=eos_text))
            new = max(1, min(kwargs["max_gen_toks"], self.max_length - 1))
            prompt = self.tok_encode(context)[-(self.max_length - new):] or [self.prefix_token_id]
            settings = (len(prompt), until, new, float(kwargs.get("temperature", 0.0)), kwargs.get("top_k"))
            jobs.append((prompt, settings))
        groups: dict[tuple, list[int]] = {}
        for i, (_, settings) in enumerate(jobs):
            groups.setdefault(settings, []).append(i)
        outputs = [""] * len(jobs)
        chunks = [(s, idx[k : k + self.batch_size]) for s, idx in groups.items()
                  for k in range(0, len(idx), self.batch_size)]
        for settings, chunk in tqdm(chunks, disable=disable_tqdm, desc="satlab generate"):
            started = time.perf_counter()
            for i, text in zip(chunk, self._generate([jobs[i][0] for i in chunk], *settings[1:]), strict=True):
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            self._timed([requests[i].task_name for i in chunk], started)
        return outputs

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], until: tuple[str, ...], max_new: int, temperature: float,
                  top_k: int | None) -> list[str]:
        """Runs ``generate`` in chunks of 16, 32, 64... new tokens and stops once every row holds a stop string,
        as ``generate`` itself only stops at end-of-text; each chunk continues the tokens so far, so greedy output
        is that of one long call."""
        start = len(prompts[0])
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        chunk = FIRST_GENERATION_CHUNK
        while True:
            ids = self.model.generate(ids, min(chunk, start + max_new - ids.shape[1]), temperature, top_k,
                                      eos_id=self.eot_token_id)
            texts = [self.tok_decode(row[start:].tolist()) for row in ids]
            if ids.shape[1] - start >= max_new or all(any(s in t for s in until) for t in texts):
                break
            chunk *= 2
        return [_cut(text, until) for text in texts]


def _cut(text: str, until: tuple[str, ...]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
