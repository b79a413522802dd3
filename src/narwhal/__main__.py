from narwhal.commands.cli import main

main()
