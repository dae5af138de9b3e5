"""``bunshin replay-server``: the replay server (``_replay``) from the command line, until interrupted."""

from __future__ import annotations

import argparse

import anyio

from ._replay import ReplayServer
from ._timing import FixedTiming, LognormalTiming, RecordedTiming, TimingModel

__all__ = ["main"]


def _timing_from_args(args: argparse.Namespace) -> TimingModel:
    fixed = FixedTiming(ttft=args.ttft, itl=args.itl)
    if args.time_model == "recorded":
        return RecordedTiming(ttft=args.ttft, fallback=fixed)
    if args.time_model == "lognormal":
        return LognormalTiming(ttft=args.ttft, itl=args.itl, sigma=args.sigma, seed=args.seed)
    return fixed


def main(argv: list[str] | None = None) -> int:
    """``bunshin replay-server``: serve a trajectory file until interrupted."""
    parser = argparse.ArgumentParser(
        prog="bunshin replay-server",
        description="Serve recorded trajectories as an OpenAI-compatible endpoint. Pick a trajectory with model "
        "'replay:<task_id>:<rollout>' or the X-Replay-Trajectory header.",
    )
    parser.add_argument("--trajectories", required=True, help="JSONL or .jsonl.gz trajectory file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--time-model", choices=["fixed", "recorded", "lognormal"], default="fixed")
    parser.add_argument("--ttft", type=float, default=0.2, help="time to first token, s (median for lognormal)")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds per token (median for lognormal)")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma")
    parser.add_argument("--seed", type=int, default=0, help="lognormal seed")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every delay (0 = no pacing)")
    parser.add_argument("--match", choices=["skeleton", "exact"], default="skeleton")
    parser.add_argument("--finish-flush", action="store_true", help="send last argument fragments with finish")
    parser.add_argument("--separate-finish", action="store_true", help="finish_reason in its own, later write")
    parser.add_argument("--preamble", help="assistant text streamed before the calls of turns recorded without")
    parser.add_argument("--default-trajectory", help="<task_id>:<rollout> served when the model names none")
    args = parser.parse_args(argv)
    server = ReplayServer(
        args.trajectories,
        host=args.host,
        port=args.port,
        timing=_timing_from_args(args),
        match=args.match,
        time_scale=args.time_scale,
        finish_flush=args.finish_flush,
        separate_finish=args.separate_finish,
        preamble=args.preamble,
        default_trajectory=args.default_trajectory,
    )

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            print(f"replay server on {server.base_url} serving {len(server.trajectories)} trajectories", flush=True)

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        pass
    return 0
