from toolrl.worker.main import main

main()
