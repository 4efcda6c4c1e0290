"""`python -m fluxtp ...` is the `fluxtp` command."""

from fluxtp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
