"""Imported by multiprocessing's fork server only (``pool.PRELOAD``), never by the server:
the fork server asks the kernel to kill it when its parent thread ends
(``PR_SET_PDEATHSIG``), so that a server killed outright (SIGKILL, SIGTERM without
shutdown) takes its fork server with it, and with that every worker process, which asks
the same of the fork server (``worker.py``), even one in an endless loop.

The parent thread is the pool's keeper thread (``pool.py``), which lives as long as the
server's process: a fork server started from any shorter-lived thread would be killed when
that thread ended, and its workers with it.
"""

from sokuji.pycode.worker import die_with_parent

die_with_parent()
