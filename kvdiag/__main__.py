from kvdiag.cli.app import main

main()
