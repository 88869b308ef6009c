"""`spotlight` command line: parses arguments and calls the library. Thin on purpose.

    spotlight run tiny                       # the demo recipe, in one process
    spotlight run my.toml grpo.lr=5e-5 --resume
    spotlight pretrain --minutes 25 --out spotlight/assets/base.safetensors
    spotlight eval --checkpoint runs/tiny/checkpoints/iter_0060.safetensors
    spotlight export --checkpoint runs/tiny/checkpoints/iter_0060.safetensors --out exported/tiny
    spotlight keys --out keys --name controller
    spotlight reserved tiny --port 5555      # reserved side of a cluster run (launch/reserved.sh)
    spotlight agent --controller tcp://HOST:5555 --workers 2   # a spot node (launch/spot.sh)
    spotlight status --controller tcp://HOST:5555 --keys keys --watch   # the fleet, live
    spotlight report runs/tiny               # runs/tiny/report.html, one self-contained page
    spotlight compare --task ocr --seeds 0,1,2 --trace ../shared/traces/aws.csv   # cost to target
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from spotlight.errors import ConfigError, SpotlightError
from spotlight.signals import sigterm_as_interrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args.func(args) or 0
    except SpotlightError as e:  # one clear line, no traceback wall
        print(f"spotlight: error: {e}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # failures of concurrent tasks: one line each
        errors = _leaves(group)
        if not all(isinstance(e, SpotlightError) for e in errors):
            raise
        for e in errors:
            print(f"spotlight: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spotlight: interrupted", file=sys.stderr)
        return 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Overrides may stand before or after options (`spotlight reserved tiny --port 5599
    run.iterations=12`): argparse fills a positional list from one run of words only, so the
    later ones come back unrecognized and join the list here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [
        leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotlight", description="GRPO post-training of DiTs on reserved + spot GPUs."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run a recipe (GRPO iterations, evaluation, checkpoints)",
        description="Run a recipe: a TOML file or a built-in name (tiny, ...), plus "
        "section.field=value overrides.",
    )
    run.add_argument("recipe", help="recipe file or built-in recipe name")
    run.add_argument("overrides", nargs="*", help="section.field=value, e.g. grpo.lr=5e-5")
    run.add_argument("--resume", action="store_true", help="continue from the run folder's newest checkpoint")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    run.set_defaults(func=_run)

    pre = sub.add_parser(
        "pretrain",
        help="pretrain the base model by flow matching on synthetic scenes",
        description="Pretrain the tiny DiT + text encoder on the synthetic compositional data set.",
    )
    pre.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget (default 25)")
    pre.add_argument("--max-steps", type=int, default=1_000_000)
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (cosine decay to 5%%)")
    pre.add_argument("--ema-decay", type=float, default=0.999, help="EMA of the weights that is saved")
    pre.add_argument("--batch-size", type=int, default=64)
    pre.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    pre.add_argument("--workers", type=int, default=0, help="rendering processes (default 0: in this one)")
    pre.add_argument("--task", default="shapes",
                     help="shapes | text (the OCR words, on a 16x64 letter + place model; default shapes)")
    pre.add_argument("--misspell", type=float, default=0.0,
                     help="text: chance a rendered letter differs from the caption's (default 0)")
    pre.add_argument("--out", type=Path, default=Path("runs/pretrain/base.safetensors"))
    pre.add_argument("overrides", nargs="*", help="model.field=value over the task's, e.g. model.layers=2")
    pre.set_defaults(func=_pretrain)

    ev = sub.add_parser(
        "eval",
        help="evaluate a checkpoint: ODE on held-out prompts, ODE on training prompts, SDE",
        description="Evaluate a checkpoint as a run does: ODE sampler on held-out prompts (headline), "
        "on training prompts, the rollout SDE; mean ± spread over seed sets.",
    )
    ev.add_argument(
        "--checkpoint", default=None,
        help="spotlight .safetensors or builtin:NAME (default: the recipe's model.checkpoint)",
    )
    ev.add_argument("--recipe", default="tiny", help="recipe giving prompts, sampler and eval settings")
    ev.add_argument("--out", type=Path, default=Path("runs/eval"), help="where the sample grid goes")
    ev.add_argument("overrides", nargs="*", help="section.field=value")
    ev.set_defaults(func=_eval)

    exp = sub.add_parser(
        "export",
        help="write a checkpoint as a diffusers model folder (+ LoRA adapter, text encoder)",
        description="Write a checkpoint for the ecosystem: transformer/ (diffusers save_pretrained), "
        "lora/ (diffusers LoRA format, under LoRA), text_encoder/, tokenizer/, "
        "spotlight.json (spotlight.export).",
    )
    exp.add_argument("--checkpoint", required=True, help="spotlight .safetensors (or builtin:base)")
    exp.add_argument("--out", type=Path, required=True, help="folder to write")
    exp.set_defaults(func=_export)

    mk = sub.add_parser(
        "make-pipeline",
        help="write a tiny random diffusers pipeline folder (qwen-image, flux, sd3)",
        description="Build a tiny random-initialised pipeline of a family (offline: tokenizers made "
        "locally) and save_pretrained it to OUT; `model.pipeline = OUT` post-trains it.",
    )
    mk.add_argument("family", choices=["qwen-image", "flux", "sd3"])
    mk.add_argument("out", help="folder to write")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_make_pipeline)

    keys = sub.add_parser(
        "keys",
        help="make a CURVE key pair for authenticated TCP",
        description="Write NAME.key (public) and NAME.key_secret (secret) into OUT.",
    )
    keys.add_argument("--out", type=Path, default=Path("keys"))
    keys.add_argument("--name", default="node")
    keys.set_defaults(func=_keys)

    res = sub.add_parser(
        "reserved",
        help="run the reserved side: controller, queue, store, trainer, reserved workers",
        description="Serve the queue, tensor store and controller on TCP, run reserved workers "
        "and the trainer; spot nodes join with `spotlight agent --controller ...`.",
    )
    res.add_argument("recipe", help="recipe file or built-in recipe name")
    res.add_argument("overrides", nargs="*", help="section.field=value")
    from spotlight.actors.config import ServeConfig
    from spotlight.actors.options import add_options

    add_options(res, ServeConfig)
    res.add_argument("--resume", action="store_true")
    res.add_argument("--no-progress", action="store_true")
    res.set_defaults(func=_reserved)

    st = sub.add_parser(
        "status",
        help="show a running reserved side: nodes, workers, SP groups, queue, leases, phase, cost",
        description="Ask a running reserved side's controller for the fleet's state, over its "
        "authenticated socket.",
    )
    st.add_argument("--controller", default="tcp://127.0.0.1:5555",
                    help="the address launch/reserved.sh printed (default tcp://127.0.0.1:5555)")
    st.add_argument("--keys", help="CURVE folder: a spot node's or the reserved node's (`spotlight keys`)")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="S",
                    help="refresh every S seconds (default 2) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print the reply as JSON")
    st.set_defaults(func=_status)

    rep = sub.add_parser(
        "report",
        help="write a run's report: one self-contained HTML page",
        description="Write RUN_DIR/report.html (recipe, evaluation curve, sample grids, capacity, "
        "cost, time per iteration), viewable with no network.",
    )
    rep.add_argument("run_dir", type=Path, help="a run folder (holds metrics.jsonl), e.g. runs/tiny")
    rep.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report.html)")
    rep.set_defaults(func=_report)

    from spotlight.actors.node.service import build_parser as agent_parser
    from spotlight.compare import MODES, SYSTEMS, CompareConfig

    cmp = sub.add_parser(
        "compare", help="systems on one task, base, seeds, trace and prices: cost and hours to a target",
        description="Reserved-only, naive spot and Spotlight (spotlight/recipes: " + ", ".join(SYSTEMS)
        + ") on the same task: iterations, hours and dollars to a held-out score (spotlight.compare). "
        "Overrides (section.field=value) apply to every system's recipe.")
    defaults = CompareConfig()
    cmp.add_argument("--task", default=defaults.task, help="task recipe: base, reward, prompts (default ocr)")
    cmp.add_argument("--systems", default=",".join(defaults.systems), help="comma-separated system names")
    cmp.add_argument("--seeds", default=",".join(map(str, defaults.seeds)), help="comma-separated run seeds")
    cmp.add_argument("--mode", default=defaults.mode, choices=MODES,
                     help="seconds and dollars from the simulated cluster or the real runtime here")
    cmp.add_argument("--target", default=defaults.target, help="held-out score, or +rise over the base")
    cmp.add_argument("--iterations", type=int, default=defaults.iterations)
    cmp.add_argument("--eval-every", type=int, default=defaults.eval_every)
    cmp.add_argument("--trace", default=None, help='spot trace file or "synthetic" (default: a fixed pool)')
    cmp.add_argument("--trace-start", type=float, default=defaults.trace_start_s,
                     help="trace second to start at")
    for name in ("profile", "gpu"):
        cmp.add_argument(f"--{name}", default=getattr(defaults, name), help=f"sim: {name}")
    for name in ("trainer_gpus", "reserved_gpus", "gpus_per_node", "fixed_spot_gpus"):
        cmp.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                         help=f"sim: {name.replace('_', ' ')}")
    cmp.add_argument("--node-factor", type=float, default=defaults.node_factor,
                     help="sim: spot nodes per trace node")
    cmp.add_argument("--cluster", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="an override of the timing runs only (repeatable)")
    cmp.add_argument("--out", default=defaults.out_dir)
    cmp.add_argument("--learning-dir", default=None,
                     help="folder of the learning runs (default OUT/learning); finished runs are reused")
    cmp.add_argument("overrides", nargs="*", help="section.field=value for every system")
    cmp.set_defaults(func=_compare)

    agent = sub.add_parser(
        "agent",
        parents=[agent_parser(add_help=False)],
        help="run a node agent (a spot node)",
        description="Join a run: register with the controller, start workers, pull requests.",
    )
    agent.set_defaults(func=_agent)
    return p


def _run(args) -> int:
    from spotlight.api import Experiment
    from spotlight.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    with sigterm_as_interrupt():
        summary = Experiment(recipe).run(resume=args.resume, progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def _pretrain(args) -> int:
    from spotlight.pretrain import PretrainConfig, pretrain, task_model

    pretrain(
        PretrainConfig(
            model=task_model(args.task, args.overrides),
            minutes=args.minutes,
            max_steps=args.max_steps,
            seed=args.seed,
            lr=args.lr,
            ema_decay=args.ema_decay,
            batch_size=args.batch_size,
            device=args.device,
            workers=args.workers,
            misspell=args.misspell,
            task=args.task,
        ),
        args.out,
    )
    return 0


def _eval(args) -> int:
    from spotlight.loop import Loop
    from spotlight.recipe import load_recipe

    chosen = [] if args.checkpoint is None else [f"model.checkpoint={json.dumps(args.checkpoint)}"]
    recipe = load_recipe(
        args.recipe,
        [
            *chosen,
            f"run.out_dir={json.dumps(str(args.out))}",
            'run.name="eval"',
            *args.overrides,
        ],
    )
    loop = Loop(recipe, progress=False)
    result = loop.evaluate(0)
    suites = {
        k.removeprefix("eval_"): {
            "reward": result[k],
            "spread": result[f"{k}_std"],
            "per_seed_set": result[f"{k}_per_set"],
            "parts": result.get(f"{k}_parts"),
            "shortfall": result.get(f"{k}_shortfall"),
        }
        for k in ("eval_ode_heldout", "eval_ode_train", "eval_sde_train")
        if k in result
    }
    print(
        json.dumps(
            {
                "checkpoint": recipe.model.checkpoint,
                "headline": result["eval_headline"],
                "eval_reward": result["eval_reward"],
                "eval_reward_std": result["eval_reward_std"],
                **suites,
                "fm_loss": result["fm_loss"],
                "samples": str(loop.out / "samples"),
            },
            indent=2,
        )
    )
    return 0


def _export(args) -> int:
    from spotlight.export import export

    print(json.dumps(export(args.checkpoint, args.out), indent=2))
    return 0


def _make_pipeline(args) -> int:
    from spotlight.pipelines.tiny import make_pipeline

    out = make_pipeline(args.family, args.out, args.seed)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps({"out": str(out), "family": args.family, "bytes": size}))
    return 0


def _reserved(args) -> int:
    from spotlight.actors.config import ServeConfig
    from spotlight.actors.options import given
    from spotlight.api import Experiment
    from spotlight.recipe import load_recipe

    def announce(rt) -> None:
        print(f"controller listening on {rt.endpoint}\nspot nodes join with: launch/spot.sh --controller "
              f"{rt.endpoint}", flush=True)

    with sigterm_as_interrupt():
        # No local spot workers unless asked for; the actors serve on TCP for spot nodes elsewhere.
        recipe = load_recipe(
            args.recipe,
            ["runtime.spot_workers=0", *args.overrides, 'run.mode="runtime"', 'runtime.transport="tcp"'],
        )
        exp = Experiment(recipe)
        exp.runtime_options = {"serve": ServeConfig(**given(args, ServeConfig))}
        exp.on_runtime.append(announce)
        summary = exp.run(resume=args.resume, progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def _status(args) -> int:
    import asyncio
    import dataclasses

    from spotlight.actors.controller.status import fetch_status, format_status

    if args.watch is not None and args.watch <= 0:
        raise SystemExit("spotlight status: --watch needs a period > 0")

    def show(reply) -> str:
        return (json.dumps(dataclasses.asdict(reply), indent=2) if args.json
                else format_status(reply, args.controller))

    if args.watch is None:
        print(show(asyncio.run(fetch_status(args.controller, keys=args.keys, timeout=args.timeout))))
        return 0
    if asyncio.run(_watch_status(args, show)):
        raise KeyboardInterrupt  # main's handler: "interrupted", exit status 130
    return 0


async def _watch_status(args, show) -> bool:
    """``status --watch``: the fleet every ``args.watch`` seconds until Ctrl-C; True when it ends so.

    Ctrl-C is taken by the event loop (``add_signal_handler``), not raised wherever the main thread
    happens to be: a KeyboardInterrupt landing in a finalizer (the sockets each poll leaves to the
    collector) is dropped by Python, and the loop would go on polling forever."""
    import asyncio
    import signal

    from spotlight.actors.controller.status import fetch_status

    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    try:
        while True:
            poll = asyncio.ensure_future(fetch_status(args.controller, keys=args.keys, timeout=args.timeout))
            stop = asyncio.ensure_future(interrupted.wait())
            await asyncio.wait({poll, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if interrupted.is_set():
                poll.cancel()
                await asyncio.gather(poll, return_exceptions=True)
                return True
            text = show(poll.result())
            print("\x1b[H\x1b[2J" + text if sys.stdout.isatty() else text + "\n", flush=True)
            try:
                async with asyncio.timeout(args.watch):
                    await interrupted.wait()
                return True
            except TimeoutError:
                pass
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _report(args) -> int:
    from spotlight.run_report import write_report

    print(write_report(args.run_dir, args.out))
    return 0


def _compare(args) -> int:
    from spotlight.compare import CompareConfig, compare

    try:
        seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated whole numbers, got {args.seeds!r}") from None
    config = CompareConfig(
        task=args.task, systems=tuple(x.strip() for x in args.systems.split(",") if x.strip()), seeds=seeds,
        mode=args.mode, target=args.target, iterations=args.iterations, eval_every=args.eval_every,
        trace=args.trace, trace_start_s=args.trace_start, profile=args.profile, gpu=args.gpu,
        trainer_gpus=args.trainer_gpus, reserved_gpus=args.reserved_gpus, gpus_per_node=args.gpus_per_node,
        fixed_spot_gpus=args.fixed_spot_gpus, node_factor=args.node_factor, overrides=tuple(args.overrides),
        cluster=tuple(args.cluster), out_dir=args.out, learning_dir=args.learning_dir)
    compare(config)
    print(f"wrote {Path(args.out) / 'compare.md'} and {Path(args.out) / 'compare.html'}")
    return 0


def _agent(args) -> int:
    from spotlight.actors.node.service import run_from_args

    return run_from_args(args)


def _keys(args) -> int:
    from spotlight.comm.auth import keys_main

    keys_main(str(args.out), args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
