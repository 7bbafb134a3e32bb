"""``python -m preproc``: see ``preproc.cli``.

The import stays under the main guard: worker processes (spawned) re-import this module and
must not load the engines again.
"""

if __name__ == "__main__":
    import sys

    from preproc.cli import main

    sys.exit(main())
