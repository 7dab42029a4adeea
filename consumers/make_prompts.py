"""Write the toy task's prompts as JSONL: ``python -m streamgrp.consumers.make_prompts [COUNT] > prompts.jsonl``."""

import sys

import orjson

from streamgrp.consumers.toy_task import prompts

if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    for prompt, _ in zip(prompts(), range(count)):
        sys.stdout.write(orjson.dumps(prompt).decode() + "\n")
