from toolrl.refserver.main import main

main()
