"""``python -m reshard``: the command line."""

from reshard.cli import main

if __name__ == "__main__":
    main()
