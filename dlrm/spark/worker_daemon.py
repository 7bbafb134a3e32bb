"""PySpark's Python worker daemon with this project's heavy modules imported once, before it forks.

Spark starts a task's Python worker by forking it from a daemon (``pyspark.daemon``); each fork
then imports what its function needs. Here that is torch, numpy, pandas and pyarrow (the
scoring and recommending tasks read datasets with ``dlrm.data`` and run models), several
seconds of CPU per worker on a small machine: imported here, in the daemon, every forked worker
starts with them loaded (copy-on-write pages, no second import). It is safe to fork after: these
imports start no threads (torch's thread pools start on first use, in the worker).

Selected by ``spark.python.daemon.module`` (``local_session`` sets it for local sessions); a
module of the same name must be importable by the executors' Python, as it is wherever this
project is installed.
"""

import numpy  # noqa: F401
import pandas  # noqa: F401
import pyarrow  # noqa: F401
import torch  # noqa: F401

from pyspark import daemon

if __name__ == "__main__":
    daemon.manager()
