from kvtool.cli.main import main

main()
