from deepinfer.cli import main

main()
