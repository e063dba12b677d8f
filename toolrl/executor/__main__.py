from toolrl.executor.main import main

main()
