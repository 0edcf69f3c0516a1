"""``launcher=slurm``: a generated sbatch script whose srun starts one torch elastic agent per node.

Why a generated script rather than submitit: what runs on the cluster is then a plain, readable
script (printed verbatim by ``launcher.dry_run=true``, kept in the run directory, editable and
re-submittable by hand), it needs no extra dependency, and every node runs the very same agent as
``launcher=torchrun`` (``python -m nxdt.launch.node``) — submitit would pickle a Python function
and hide the srun line behind its own runner.

Node order: the node rank is ``$SLURM_NODEID``, i.e. the order of the job's node list, which Slurm's
topology plugin (topology/tree, topology/block for UltraServer-like domains) makes follow the
network; the c10d rendezvous runs on the first node of that list.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def sbatch_script(cfg: Any, plan: Any, run_dir: Path, python: str | None = None) -> str:
    launcher, nodes = cfg.launcher, plan.num_nodes
    python = python or sys.executable
    layout = "×".join(f"{d.upper()}{n}" for d, n in plan.degrees.items() if n > 1) or "one replica"
    options = [
        f"--job-name={cfg.name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--time={launcher.time_limit}",
        f"--output={run_dir}/logs/slurm-%j.out",
    ]
    options += [f"--partition={launcher.partition}"] if launcher.partition else []
    options += [f"--account={launcher.account}"] if launcher.account else []
    gpus = gpus_per_node(cfg, plan)
    options += [f"--gpus-per-node={gpus}"] if gpus else []
    options += list(launcher.sbatch_args)
    node_cmd = shlex.join([python, "-m", "nxdt.launch.node", str(run_dir)])
    return "\n".join(
        [
            "#!/bin/bash",
            f"# nxdt: {cfg.name} on {nodes} nodes × {plan.ranks_per_node} ranks ({layout}); written by `nxdt train launcher=slurm`",
            *(f"#SBATCH {o}" for o in options),
            "set -euo pipefail",
            "export PYTHONUNBUFFERED=1",
            "# nxdt's keys in the rendezvous store are signed with a secret only this job's processes hold (srun hands",
            "# this environment to every node); a local user who reaches the store's port cannot steer a rank.",
            f"export NXDT_STORE_SECRET=\"${{NXDT_STORE_SECRET:-$({shlex.quote(python)} -c 'import secrets; print(secrets.token_hex(32))')}}\"",
            "# The c10d rendezvous runs on the job's first node (Slurm lists nodes in its topology-aware order).",
            'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "addr=$(scontrol show node \"$first\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            "# One torch elastic agent per node; each takes its node rank from $SLURM_NODEID.",
            f'srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --label --kill-on-bad-exit=1 \\',
            f'    {node_cmd} --rdzv-endpoint "${{addr:-$first}}:{launcher.port}" --rdzv-id "$SLURM_JOB_ID"',
            "",
        ]
    )


def gpus_per_node(cfg: Any, plan: Any) -> int:
    """The GPUs a node of the job asks Slurm for: ``launcher.gpus_per_node``, else on a GPU instance the ones the plan
    places ranks on (ranks beyond the GPU count share them); 0 (no ``--gpus-per-node``) elsewhere. Where Slurm manages
    GPUs as a generic resource, a job that asks for none sees none."""
    asked = cfg.launcher.gpus_per_node
    if asked is not None:
        return int(asked)
    if cfg.instance.accelerator != "cuda":
        return 0
    return min(plan.ranks_per_node, int(cfg.instance.devices))


def sbatch_command(script: Path, wait: bool) -> list[str]:
    return ["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)]


def submit(cfg: Any, plan: Any, run_dir: Path) -> int:
    """Write ``job.sbatch`` into the (already written) run directory and submit it."""
    script = run_dir / "job.sbatch"
    script.write_text(sbatch_script(cfg, plan, run_dir))
    command = sbatch_command(script, cfg.launcher.wait)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        print(
            "nxdt: sbatch not found: launcher=slurm submits from a Slurm login node (or use launcher=torchrun)", file=sys.stderr
        )
        return 2
    job_id = proc.stdout.readline().strip().split(";")[0] if proc.stdout else ""
    if job_id:
        print(
            f"nxdt: submitted Slurm job {job_id} ({plan.num_nodes} nodes × {plan.ranks_per_node} ranks); script {script}, "
            f"log {run_dir / 'logs' / f'slurm-{job_id}.out'}",
            flush=True,
        )
    out, err = proc.communicate()
    if proc.returncode != 0:
        first = (err or out or "").strip().splitlines()
        what = "job failed" if job_id else "sbatch failed"
        print(
            f"nxdt: Slurm {what} (exit {proc.returncode}): {first[-1] if first else ''} — see {run_dir / 'logs'}", file=sys.stderr
        )
        return 1
    if cfg.launcher.wait:
        print(f"nxdt: Slurm job {job_id} finished", flush=True)
    return 0
