from narwhal.cli import main

main()
