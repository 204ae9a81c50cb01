"""The end-to-end suite (issue 27): real vLLM API servers with shmtier (conftest.py).

A package, so that its modules import each other relatively and its conftest is
``e2e.conftest``: a second top-level ``conftest`` module would replace the suite-wide one
in ``sys.modules``, which tests import (``import conftest``)."""
