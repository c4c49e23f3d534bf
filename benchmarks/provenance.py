"""The lines every benchmark table starts with: the command that made it, the machine, the
date."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys

import torch


def provenance() -> list[str]:
    command = shlex.join(["python", *sys.argv])  # quoted: the command can be pasted back
    return [
        f"Command: `{command}`",
        f"Date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), Python {sys.version.split()[0]}",
        "",
    ]
