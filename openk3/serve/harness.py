"""An lm-evaluation-harness model for openk3 checkpoints: `openk3 lm-eval` (lm_eval's own arguments) or, in Python,

    import openk3.serve.harness                     # registers the model name "openk3" with lm_eval
    lm_eval.simple_evaluate(model="openk3", model_args="pretrained=DIR", tasks=[...])

NOTE: lm_eval 0.4 finds models only in its own registry (no plugin entry points), so a bare `lm_eval --model openk3`
cannot see this module; `openk3 lm-eval --model openk3 --model_args pretrained=DIR --tasks ...` imports it first and
then runs lm_eval's command line unchanged.

Scoring (`loglikelihood`, `loglikelihood_rolling`) is one full forward per request over context + continuation (the
log-probabilities of given tokens are a forward pass, not generation). `generate_until` runs through the inference
engine (continuous batching, prefix cache), greedy unless the task asks to sample, and stops at the first of the
task's `until` strings (checked on the decoded text after every engine step) or the model's stop token.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as error:  # an optional dependency: say how to get it
    raise ImportError(f"openk3's lm-eval model needs lm-evaluation-harness ({error}): "
                      f"pip install 'openk3[eval]'") from error

from openk3.model.checkpoint import load_for_inference
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.sampler import SamplingParams


@register_model("openk3")
class OpenK3LM(LM):
    """model_args: pretrained=DIR (a checkpoint or run directory), device=cpu|cuda, max_length (context cut from
    the left for scoring; default the model's max_position_embeddings), max_gen_toks (default 256)."""

    def __init__(self, pretrained: str, device: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, batch_size: int | str = 1, **_ignored):
        super().__init__()
        # NOTE: lm_eval's command line passes device="cuda:0" unless told otherwise; like lm_eval's own HF model,
        # run on the CPU where there is no GPU, and say so
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:
                print(f"openk3 lm-eval: device {device!r} asked for, but torch sees no GPU: using the CPU",
                      file=sys.stderr)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tokenizer, _ = load_for_inference(pretrained, device=device)
        self.torch_device = torch.device(device)
        self.max_length = int(max_length or self.model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        # room for a few requests of a full scoring window (capped at 32K tokens) plus their generations
        page = 64
        tokens = min(self.max_length, 32768) + self.max_gen_toks + page
        self.engine = Engine(self.model, EngineConfig(page_size=page, num_pages=4 * (-(-tokens // page)) + 8))

    @property
    def device(self) -> torch.device:  # lm_eval reads it to place its own tensors
        return self.torch_device

    # ---- scoring
    @torch.inference_mode()
    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether greedy decoding would have produced it."""
        ids = (context + continuation)[-(self.max_length + 1):]
        n = len(continuation)
        if n == 0:
            return 0.0, True
        if len(ids) <= n:  # the first scored token needs a token before it
            raise ValueError(f"lm-eval: a {n}-token continuation needs at least one context token before it within "
                             f"max_length={self.max_length} (context: {len(context)} tokens; no BOS is prepended)")
        x = torch.tensor([ids[:-1]], device=self.torch_device)
        logits = self.model(x).logits[0, -n:].float()
        target = torch.tensor(ids[-n:], device=self.torch_device)
        logp = F.log_softmax(logits, -1)
        return float(logp.gather(-1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            out.append(self._continuation_logprob(self.tokenizer.encode(context), self.tokenizer.encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of a whole text: every token after the first, scored in windows of max_length."""
        out = []
        for req in requests:
            ids = self.tokenizer.encode(req.args[0])
            total, start = 0.0, 1
            while start < len(ids):
                end = min(len(ids), start + self.max_length)
                lp, _ = self._continuation_logprob(ids[max(0, start - self.max_length):start], ids[start:end])
                total += lp
                start = end
            out.append(total)
        return out

    # ---- generation
    def generate_until(self, requests) -> list[str]:
        jobs = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = kwargs.get("do_sample", False) and kwargs.get("temperature", 1.0) > 0
            params = SamplingParams(max_tokens=int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                                    temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                                    seed=kwargs.get("seed"))
            prompt = self.tokenizer.encode(context)[-self.max_length:]
            jobs.append((self.engine.submit(prompt, params), until))
        texts = [""] * len(jobs)
        done = [False] * len(jobs)
        while not all(done):
            self.engine.step()
            for i, (r, until) in enumerate(jobs):
                if done[i]:
                    continue
                text = self.tokenizer.decode(r.completion_ids if r.finished else r.output)
                cut = min((text.find(s) for s in until if s and s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    if not r.finished:
                        self.engine.cancel(r.id)
                if cut >= 0 or r.finished:
                    texts[i], done[i] = text, True
        while self.engine.has_work():  # let cancelled requests leave and free their pages
            self.engine.step()
        return texts


def register_commands(sub: argparse._SubParsersAction) -> None:
    """`openk3 lm-eval ARGS`: lm_eval's command line, unchanged, with the "openk3" model registered."""
    p = sub.add_parser("lm-eval", add_help=False)  # --help goes to lm_eval too
    p.set_defaults(fn=run_lm_eval, passthrough=True)


def run_lm_eval(args: argparse.Namespace) -> None:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *args.extra]
    cli_evaluate()
