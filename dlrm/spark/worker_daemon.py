"""PySpark's Python worker daemon with torch and numpy imported once, before it forks workers.

Spark starts a task's Python worker by forking it from a daemon (``pyspark.daemon``); each fork
then imports what its function needs. Here that is torch (scoring and recommending read datasets
with ``dlrm.data`` and run models; preprocessing's workers import ``dlrm`` too): seconds of CPU
per worker. Imported here, in the daemon, every forked worker starts with it loaded
(copy-on-write pages, no second import), so a session pays for it once, not once per worker.

Safe to fork after: importing torch and numpy starts no thread of theirs but OpenBLAS's pool,
which OpenBLAS stops before a fork and restarts after (its own atfork handlers); torch's thread
pools start on first use, in the worker. pandas and pyarrow are not imported here: pyarrow's
allocator starts a background thread at import.

Selected by ``spark.python.daemon.module`` (``dlrm.spark.launch.local_session`` and
preprocessing's local sessions set it); the executors' Python must import this module, as it
does wherever this project is installed.
"""

import numpy  # noqa: F401
import torch  # noqa: F401

from pyspark import daemon

if __name__ == "__main__":
    daemon.manager()
