"""``helios rank``: one tensor-parallel rank process joining a ``helios run --rank-listen`` leader.

Owns the command's options and its lifecycle: verify the core with the same trust options as ``helios run``,
read the shared secret (:func:`~helios_core.backends.rank_processes.read_secret_file`), connect to the leader
(retrying until it listens, for at most ``--rank-join-timeout`` seconds), authenticate both ways, load this
rank's resources with the leader's geometry on the leader's backend (reference, or CUDA on GPU ``--device``),
then execute the leader's rounds until it says stop (exit 0 with the reason it gave). A leader that goes away,
refuses this rank or cannot be authenticated ends the process with one error line and exit status 1.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["add_rank_command", "cmd_rank"]


def cmd_rank(args: argparse.Namespace, *, write: Callable[[str], None]) -> int:
    """Run the rank; its status lines go to ``write`` (the CLI's stderr), prefixed ``helios rank:``."""
    from helios_core.backends.rank_processes import (
        DEFAULT_JOIN_TIMEOUT_S,
        parse_address,
        read_secret_file,
        run_rank_process,
    )
    from helios_core.errors import StartupError
    from helios_core.loading import TrustSettings, open_core

    def say(line: str) -> None:
        write(f"helios rank: {line}")

    host, port = parse_address(args.join, "--join")
    secret = read_secret_file(args.rank_secret_file)
    if args.rank_join_timeout is not None and not args.rank_join_timeout > 0:
        raise StartupError(f"--rank-join-timeout must be a positive number of seconds, not {args.rank_join_timeout}")
    settings = TrustSettings.resolve(args.trust_key, args.accept, args.core_key)
    verified = open_core(args.core, settings, check_resources=False)
    try:
        reason = run_rank_process(
            verified.contract,
            verified.core,
            host,
            port,
            args.rank,
            secret,
            timeout_s=DEFAULT_JOIN_TIMEOUT_S if args.rank_join_timeout is None else args.rank_join_timeout,
            announce=say,
            device=args.device,
        )
    finally:
        verified.close()
    say(f"stopped: {reason}")
    return 0


def add_rank_command(
    sub: Any, trust_arguments: Callable[[argparse.ArgumentParser], None], write: Callable[[str], None]
) -> None:
    """Register ``helios rank`` (``trust_arguments`` adds ``--trust-key``, ``--accept``, ``--core-key``;
    ``write`` puts one status line where the CLI writes them)."""
    rank = sub.add_parser(
        "rank",
        help="run one tensor-parallel rank of a core for a leader started with helios run --rank-listen",
        description="Joins the leader at --join, authenticates with the shared secret, loads this rank's part of "
        "the core and executes the leader's rounds until the leader stops.",
    )
    rank.add_argument("--core", type=Path, required=True, help="the core (the same file the leader serves)")
    rank.add_argument("--join", required=True, metavar="HOST:PORT", help="the leader's --rank-listen address")
    rank.add_argument("--rank", type=int, required=True, metavar="R", help="this process's rank, 1..N-1")
    rank.add_argument(
        "--rank-secret-file",
        type=Path,
        required=True,
        metavar="FILE",
        help="the secret shared with the leader (a private file: mode 0600)",
    )
    rank.add_argument(
        "--rank-join-timeout",
        type=float,
        metavar="SECONDS",
        help="how long to keep trying to reach the leader (default 60)",
    )
    rank.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="the GPU this rank runs on when the leader serves on the CUDA backend (default: the rank's number "
        "modulo the GPUs visible, so the ranks of one host take GPUs of their own)",
    )
    trust_arguments(rank)
    rank.set_defaults(handler=functools.partial(cmd_rank, write=write))
