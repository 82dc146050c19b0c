from prunetool.cli import main

main()
