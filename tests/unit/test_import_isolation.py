import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["streamgrp.fold", "streamgrp.partition", "streamgrp.codec", "streamgrp.segments",
                                    "streamgrp"])
def test_pure_modules_do_not_import_redis_torch_or_prometheus(module):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('redis', 'torch', 'prometheus_client') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_lazy_torch_exports_resolve():
    import streamgrp

    assert callable(streamgrp.normalize)
    with pytest.raises(AttributeError):
        streamgrp.does_not_exist  # noqa: B018
