#!/usr/bin/env python3
"""Write docs/cli.md from the CLI's own argparse parsers, so the reference lists
every verb and option that exists. Run after adding or changing a verb:

    PYTHONPATH=. python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    PYTHONPATH=. python scripts/gen_cli_docs.py --check  # exit 1 if it is stale

tests/test_docs.py runs the check.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HEADER = """# CLI reference

Every verb and option of `hpc-verl VERB [options]`, with examples. This file is
generated from the parsers by `scripts/gen_cli_docs.py` (the tests fail when it
is stale); the examples are kept in that script.

Every user error is one line on stderr and exit status 2; `doctor` exits 1 when
a check FAILs. Profiles are looked up by name on the search path
(`./cluster_profiles`, the user directory, `$HPC_VERL_PROFILE_PATH`, the shipped
ones) or given as a path to a `.yaml` file; `--set key=value` overrides a
profile value for one command.
"""

# Hand-written examples per verb (shown under the verb's help).
EXAMPLES: dict[str, str] = {
    "profiles": """hpc-verl profiles list
hpc-verl profiles show ib-a100 --set slurm.nodes=4""",
    "render": """hpc-verl render --profile ib-a100 --config job.yaml trainer.total_epochs=2 -o job.sbatch
hpc-verl render --profile local --check
# verl's own command line, as you run it: its trainer.nnodes / n_gpus_per_node ask for the allocation
hpc-verl render --profile ib-a100 -o job.sbatch -- python3 -m verl.trainer.main_ppo trainer.nnodes=1 ...""",
    "submit": """hpc-verl submit --profile ib-a100 --config job.yaml trainer.total_epochs=2
hpc-verl submit --profile ib-a100 -- python3 -m verl.trainer.main_ppo --config-name ppo_megatron_trainer ...
hpc-verl submit --ray-address http://HEAD:8265 --profile local --config examples/job_verl_cpu.yaml""",
    "import-verl": """DEVICE=gpu hpc-verl import-verl run_qwen3_8b_fsdp.sh -o job.yaml   # read, never run
hpc-verl submit --profile ib-a100 --config job.yaml""",
    "validate": """hpc-verl validate --profile ib-a100
hpc-verl validate --all""",
    "doctor": """# on a compute node (or inside the job before Ray starts)
hpc-verl doctor --profile ib-a100
hpc-verl doctor --profile ib-a100 --job-id "$SLURM_JOB_ID" --deep   # also look inside the container
hpc-verl doctor --profile local --json | jq '.checks[] | select(.status != "OK")'""",
    "attach": """hpc-verl attach 81234                        # a shell in the head node's container
hpc-verl attach 81234 -- ray status          # a command there, with the job's RAY_ADDRESS and token
hpc-verl attach 81234 --node 3 -- nvidia-smi # the 4th node (0 is the head), or --node gpu-node-4""",
    "plan": """hpc-verl plan --profile ib-a100 --nodes 4 --model-size 7B
# paste the overrides into a submission
hpc-verl submit --profile ib-a100 --set slurm.nodes=4 --config job.yaml \\
  $(hpc-verl plan --profile ib-a100 --nodes 4 --format overrides)""",
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    os.environ["COLUMNS"] = "100"
    from hpc_verl.cli.main import build_parser

    parser = build_parser()
    verbs = _subparsers(parser)  # verb name -> parser, in VERB_MODULES order
    out = [HEADER, "Verbs: " + ", ".join(f"[`{v}`](#hpc-verl-{v})" for v in verbs) + "\n"]
    for name, sub in verbs.items():
        out.append(f"## hpc-verl {name}\n")
        out.append("```text\n" + sub.format_help().replace(sys.argv[0], "hpc-verl").rstrip() + "\n```\n")
        for child_name, child in _subparsers(sub).items():
            out.append(f"### hpc-verl {name} {child_name}\n")
            out.append("```text\n" + child.format_help().rstrip() + "\n```\n")
        if name in EXAMPLES:
            out.append("Examples:\n\n```bash\n" + EXAMPLES[name] + "\n```\n")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not up to date")
    args = ap.parse_args()
    target = REPO / "docs" / "cli.md"
    text = render()
    if args.check:
        if not target.is_file() or target.read_text() != text:
            print("docs/cli.md is stale: run PYTHONPATH=. python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    from hpc_verl.util.fs import atomic_write_text

    atomic_write_text(target, text)
    print(f"wrote {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
