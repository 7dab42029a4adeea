"""Examples built on streamgrp: the reference GRPO trainer, the LM trainer and the demo's toy task.

This folder installs as ``streamgrp.consumers`` (``streamgrp/consumers`` is a link to it), so a wheel
puts nothing but ``streamgrp`` at the top level. The library names these modules only in
"module:function" strings (``streamgrp.consumers.grpo_trainer:train``) and never imports them; they
import torch, which the ``trainer`` extra brings.
"""
