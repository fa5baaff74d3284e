import sys

from .cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        from .compare import run

        run(sys.argv[2:])
    else:
        main()
