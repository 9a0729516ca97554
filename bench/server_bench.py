"""Load benchmark of the OpenAI-compatible server (openk3/serve/server.py); prints a table and writes JSON.

    python bench/server_bench.py                               # in-process server, random-init tiny model, CPU
    python bench/server_bench.py --url http://127.0.0.1:8000 --model NAME   # a running `openk3 serve`

For each concurrency level c, `--requests` streaming /v1/completions requests are sent by c client threads (each
sends its next request when the last one ends). Per level: requests/s and output tokens/s over the level's wall
time, time to first token (TTFT: request sent -> first streamed token) and inter-token latency (ITL: the gaps
between a request's streamed text events) at p50 and p99. Requests are greedy /v1/completions with a prompt of
random ids and --max-tokens tokens each (a random model rarely samples eos). NOTE: a token that ends inside a
multi-byte character is sent with the next one, so ITL is per text event, and tok/s counts text events: both are
per token only for text that decodes token by token. Prompts differ per request (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import hardware  # noqa: E402  (bench/ is the script's directory)

from openk3.config import get_config  # noqa: E402
from openk3.model import K3ForCausalLM, count_params  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig  # noqa: E402
from openk3.serve.server import Server, create_app  # noqa: E402
from openk3.text.tokenizer import train_bpe  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def one_request(http: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; the arrival time of every token-carrying event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    arrivals = []
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals}


def run_level(url: str, model: str, concurrency: int, n: int, prompt_tokens: int, max_tokens: int, vocab: int,
              seed: int) -> dict:
    rng = random.Random(seed)
    # ids from 300 up: plain BPE merges, clear of the special tokens (0..14) and the eos
    prompts = [[rng.randrange(300, vocab) for _ in range(prompt_tokens)] for _ in range(n)]
    with httpx.Client(timeout=600) as http, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda p: one_request(http, url, model, p, max_tokens), prompts))
        wall = time.perf_counter() - start
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(len(r["arrivals"]) for r in results)
    return {"concurrency": concurrency, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "streamed_tokens_per_s": tokens / wall, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def start_local_server(args: argparse.Namespace):
    """A random-init preset model with a BPE tokenizer trained on a few stdlib files, served on 127.0.0.1."""
    config = get_config(args.preset)
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(lib / f).read_text() for f in ("textwrap.py", "json/decoder.py", "bisect.py", "difflib.py")]
    tokenizer = train_bpe(texts, vocab_size=config.vocab_size)
    config = config.replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(config).eval()
    engine = Engine(model, EngineConfig(page_size=64, num_pages=1024, max_batch=max(args.concurrency)))
    server = Server(create_app(engine, tokenizer, args.model)).start()
    return server, tokenizer.vocab_size, count_params(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one in-process)")
    p.add_argument("--model", default="k3-bench", help="the served model name")
    p.add_argument("--vocab-size", type=int, default=2048, help="with --url: prompt ids are drawn below this")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads for the in-process server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/server_bench.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    server, params = None, None
    url, vocab = args.url, args.vocab_size
    if url is None:
        server, vocab, params = start_local_server(args)
        url = server.url
    hw = hardware(torch.device("cpu")) if server is not None else {"server": url}
    print(f"server {url}  model {args.model}  prompt {args.prompt_tokens} tokens  max_tokens {args.max_tokens}  "
          f"{args.requests} requests per level")
    print(f"hardware {hw}")
    run_level(url, args.model, 1, 2, args.prompt_tokens, 4, vocab, args.seed + 999)  # warm-up
    rows = []
    print(f"{'conc':>5} {'req/s':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9}")
    for c in args.concurrency:
        row = run_level(url, args.model, c, args.requests, args.prompt_tokens, args.max_tokens, vocab, args.seed + c)
        rows.append(row)
        print(f"{c:>5} {row['requests_per_s']:>8.2f} {row['streamed_tokens_per_s']:>8.1f} "
              f"{row['ttft_p50_s'] * 1e3:>7.0f}ms {row['ttft_p99_s'] * 1e3:>7.0f}ms "
              f"{row['itl_p50_s'] * 1e3:>7.1f}ms {row['itl_p99_s'] * 1e3:>7.1f}ms")
    if server is not None:
        server.stop()
    result = {"command": " ".join(sys.argv), "url": args.url, "preset": args.preset if server else None,
              "params": params, "hardware": hw, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "levels": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
