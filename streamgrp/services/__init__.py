"""Long-running roles, each a thin driver around a core fold: worker, feeder, assembler, batcher,
archiver, retention. They read, commit (handing typed records to a store adapter, never argument lists)
and acknowledge; the rules live in `streamgrp.core`. They are handed a metrics object and never import
prometheus_client or torch.
"""
