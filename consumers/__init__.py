"""Stream consumers built on streamgrp: the reference GRPO trainer and the demo's toy task."""
