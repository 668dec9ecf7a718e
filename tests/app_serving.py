"""Serve a test's Gradio app on 127.0.0.1, robust to Gradio's liveness check on a loaded CI machine."""
from __future__ import annotations

LOCALHOST_CHECK = "When localhost is not accessible"


def launch_local(demo, attempts: int = 3, **kwargs) -> None:
    """``demo.launch`` on 127.0.0.1, a free port, without blocking.

    Gradio's ``launch`` sends one HEAD request to the new server with a 3 s timeout and, on a timeout, raises
    "When localhost is not accessible, a shareable link must be created" (CI stop 40: the app's first page took
    longer than 3 s on 2 loaded cores; locally it takes 0.4-1.2 s). That error (and only it) is retried after closing
    the half-started server; any other error, or the same one ``attempts`` times, is raised.

    Raises:
        ValueError: Gradio's own error when every attempt timed out.
    """
    for attempt in range(attempts):
        try:
            demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True, **kwargs)
            return
        except ValueError as error:
            if LOCALHOST_CHECK not in str(error) or attempt == attempts - 1:
                raise
            demo.close()
