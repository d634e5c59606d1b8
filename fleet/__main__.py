from fleet.ops.cli import main

main()
