"""The `openk3` command: info, init, train, eval, generate, chat, serve.

Each subcommand is a small function that parses its own arguments and calls into the package."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_info(args: argparse.Namespace) -> None:
    import torch

    from openk3.config import get_config
    from openk3.model import count_params
    from openk3.ops import select_kda_backend, select_moe_backend

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
    if args.json:
        print(json.dumps(info))
        return
    print(f"config           {args.config}")
    print(f"total params     {counts['total_params']:,} ({counts['total_params']:.4e})")
    print(f"active params    {counts['active_params']:,} ({counts['active_params']:.4e}) per token, "
          f"excluding the input embedding")
    print(f"layers           {n}: {kda} KDA + {n - kda} MLA, {info['moe_layers']} MoE")
    print(f"AttnRes block    {config.attn_res_block_size}   LatentMoE {config.latent_moe}   "
          f"MXFP4 experts {config.mxfp4_experts}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kb = select_kda_backend(device)
    mb = select_moe_backend(device.type, torch.float32)
    print(f"KDA backend      {kb.name} on {device.type}: {kb.reason}")
    print(f"MoE backend      {mb.name} on {device.type} fp32: {mb.reason}")


def cmd_init(args: argparse.Namespace) -> None:
    from openk3.model.checkpoint import init_checkpoint
    from openk3.config import get_config

    init_checkpoint(get_config(args.config), args.out, seed=args.seed)
    print(f"wrote a randomly initialised {args.config} checkpoint to {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3: model, training, inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts and layer schedule of a config (nothing is allocated)")
    p.add_argument("--config", default="tiny", help="preset (kimi-k3, kimi-linear-48b, tiny) or config.json path")
    p.add_argument("--json", action="store_true", help="print JSON with total_params and active_params")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("init", help="write a randomly initialised checkpoint in the released layout")
    p.add_argument("--config", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_init)

    from openk3.serve import engine, server
    from openk3.train import trainer

    trainer.add_commands(sub)  # train, eval
    engine.register_commands(sub)  # generate, chat
    server.register_commands(sub)  # serve

    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"openk3 {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
