"""`python -m vat` (and `accelerate launch -m vat ...`) runs the same CLI as the `vat` script."""

from vat.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
