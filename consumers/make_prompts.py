"""Write the toy task's prompts as JSONL: ``python -m streamgrp.consumers.make_prompts [COUNT] > prompts.jsonl``."""

import argparse
import sys

import orjson

from streamgrp.consumers.toy_task import prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamgrp.consumers.make_prompts",
        description="Write the demo's toy task prompts as JSONL on standard output "
        "(a dataset for streamgrp batcher --dataset).",
    )
    parser.add_argument("count", nargs="?", type=int, default=10_000, help="how many prompts [default 10000]")
    count = parser.parse_args(argv).count
    if count < 0:
        parser.error("count must be 0 or more")
    for prompt, _ in zip(prompts(), range(count)):
        sys.stdout.write(orjson.dumps(prompt).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
