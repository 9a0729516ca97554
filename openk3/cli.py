"""The `openk3` command: info, init, train, eval, generate, chat, serve, lm-eval, convert, render,
posttrain-data, sft, rl, distill, posttrain-demo.

A command imports only what it needs: `openk3 info` never loads the trainer, `openk3 train` never loads FastAPI.
`COMMANDS` names the module that defines each command and its line in `openk3 --help`. Only the module of the
command being run is imported, and its `register_commands(sub)` adds that command's parser with all its flags;
every other command gets a bare parser, there only so `openk3 --help` lists it. info and init live here."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# command -> (the module whose register_commands defines it, its one-line help)
COMMANDS = {
    "info": ("openk3.cli", "parameter counts and layer schedule of a config (nothing is allocated)"),
    "init": ("openk3.cli", "write a randomly initialised checkpoint in the released layout"),
    "train": ("openk3.train.trainer", "train a model (default: tiny preset on the stdlib, CPU, about 5 minutes)"),
    "eval": ("openk3.train.trainer", "validation loss and bits per byte of a trained model"),
    "generate": ("openk3.serve.engine", "continue a prompt with the inference engine"),
    "chat": ("openk3.serve.engine", "multi-turn chat in the terminal (shows cached prompt tokens per turn)"),
    "serve": ("openk3.serve.server", "an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine"),
    "lm-eval": ("openk3.serve.harness", "lm-evaluation-harness on a checkpoint (lm_eval's own arguments; "
                                        "needs openk3[eval])"),
    "convert": ("openk3.parallel.dcp", "convert a sharded DCP checkpoint to the release safetensors layout, or back"),
    "render": ("openk3.text.chat", "print a conversation rendered as the model's chat prompt (text, segments, ids)"),
    "posttrain-data": ("openk3.posttrain.synth", "write synthetic SFT trajectories (general, agent, coding)"),
    "sft": ("openk3.posttrain.sft", "supervised fine-tuning on XTML conversations (loss on assistant tokens)"),
    "rl": ("openk3.posttrain.rl", "GRPO for one domain/effort policy: budget penalty, partial rollouts"),
    "distill": ("openk3.posttrain.distill", "multi-teacher on-policy distillation of the nine policies into one"),
    "posttrain-demo": ("openk3.posttrain.demo", "SFT -> RL (3 domains x 3 efforts) -> MOPD, tiny, on the CPU"),
}


def cmd_info(args: argparse.Namespace) -> None:
    import torch

    from openk3.config import get_config
    from openk3.model import count_params
    from openk3.ops import select_kda_backend, select_moe_backend
    from openk3.ops.mla_decode import select_paged_attention

    config = get_config(args.config)
    counts = count_params(config)
    n = config.num_hidden_layers
    kda = config.layer_types.count("kda")
    info = {
        **counts,
        "layers": n,
        "kda_layers": kda,
        "mla_layers": n - kda,
        "moe_layers": sum(config.is_moe_layer(i) for i in range(n)),
        "attn_res_block_size": config.attn_res_block_size,
        "latent_moe": config.latent_moe,
        "mxfp4_experts": config.mxfp4_experts,
    }
    if config.vision_config is not None:  # the release: MoonViT-V2 ~401M + the projector ~46M (K3_SPEC section 10)
        from openk3.vision.model import count_vision_params

        info.update(count_vision_params(config.vision_config))
    if args.json:
        print(json.dumps(info))
        return
    print(f"config           {args.config}")
    print(f"total params     {counts['total_params']:,} ({counts['total_params']:.4e})")
    print(f"active params    {counts['active_params']:,} ({counts['active_params']:.4e}) per token, "
          f"excluding the input embedding")
    if config.vision_config is not None:
        print(f"vision tower     {info['vision_params']:,} ({info['vision_params']:.4e}), projector "
              f"{info['projector_params']:,} ({info['projector_params']:.4e}); not in the counts above")
    print(f"layers           {n}: {kda} KDA + {n - kda} MLA, {info['moe_layers']} MoE")
    print(f"AttnRes block    {config.attn_res_block_size}   LatentMoE {config.latent_moe}   "
          f"MXFP4 experts {config.mxfp4_experts}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kb = select_kda_backend(device)
    mb = select_moe_backend(device.type, torch.float32)
    print(f"KDA backend      {kb.name} on {device.type}: {kb.reason}")
    print(f"MoE backend      {mb.name} on {device.type} fp32: {mb.reason}")
    mla_on, mla_why = select_paged_attention(device, torch.bfloat16)
    print(f"MLA decode step  {'paged kernel' if mla_on else 'gather'} on {device.type} bf16: {mla_why}")


def cmd_init(args: argparse.Namespace) -> None:
    from openk3.config import get_config
    from openk3.model.checkpoint import init_checkpoint

    tokenizer = None
    if args.data is not None and args.tokenizer != "bpe":
        raise ValueError(f"--data {args.data} is the corpus for --tokenizer bpe; with --tokenizer {args.tokenizer} "
                         f"it would be ignored")
    if args.tokenizer == "bpe":  # the byte-level BPE `openk3 train` trains, at the config's vocabulary size
        from openk3.text.tokenizer import train_bpe
        from openk3.train.data import load_corpus

        tokenizer = train_bpe((d.text for d in load_corpus(args.data)), get_config(args.config).vocab_size)
    elif args.tokenizer is not None:
        from openk3.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_path(args.tokenizer)
    config = init_checkpoint(get_config(args.config), args.out, seed=args.seed, tokenizer=tokenizer)
    with_tok = "" if tokenizer is None else f" with its tokenizer (vocabulary {config.vocab_size})"
    print(f"wrote a randomly initialised {args.config} checkpoint to {args.out}{with_tok}")


class _NamesFormatter(argparse.HelpFormatter):
    """Help text wrapped at spaces only: a preset name (tiny-vl, kimi-linear-48b) is never cut at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `info` and `init` (their one-line help is in `COMMANDS`)."""
    from openk3.config import PRESETS  # stdlib only: the help names the presets there are, not a copied list

    config_help = f"preset ({', '.join(PRESETS)}) or config.json path [tiny]"
    p = sub.add_parser("info", formatter_class=_NamesFormatter)
    p.add_argument("--config", default="tiny", help=config_help)
    p.add_argument("--json", action="store_true", help="print JSON with total_params and active_params (of the text "
                   "model), and vision_params and projector_params for a config with a vision_config")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("init", formatter_class=_NamesFormatter)
    p.add_argument("--config", default="tiny", help=config_help)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="save a tokenizer with the checkpoint (the vocabulary and token ids follow "
                   "it): a tokenizer directory, tokenizer.json or tiktoken.model, or `bpe` to train the byte-level "
                   "BPE of `openk3 train` on --data")
    p.add_argument("--data", help="corpus for --tokenizer bpe (a file, .jsonl or directory) [the stdlib's .py files]")
    p.set_defaults(fn=cmd_init)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3: model, training, inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    # The top-level parser has no options of its own, so the command, if any, is the first argument.
    chosen = COMMANDS[argv[0]][0] if argv and argv[0] in COMMANDS else None
    registered = False
    for name, (module, help) in COMMANDS.items():
        if module != chosen:
            sub.add_parser(name, help=help)
        elif not registered:
            # NOTE: under `python -m openk3.cli` this file is __main__; importing "openk3.cli" would run it twice.
            this = sys.modules[__name__]
            (this if module == "openk3.cli" else importlib.import_module(module)).register_commands(sub)
            registered = True
    # A command that hands its arguments to another program (lm-eval) sets `passthrough`; every other one is strict.
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.extra = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.fn(args)
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit flush
    except BrokenPipeError:  # `openk3 info | head -1`: the reader left; say nothing, as a killed-by-SIGPIPE program
        # NOTE: stdout still holds unwritten bytes; point it at devnull so the exit flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE
    except (ValueError, OSError) as e:  # bad input: a config, a flag, a missing or unreadable file (CheckpointError)
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
