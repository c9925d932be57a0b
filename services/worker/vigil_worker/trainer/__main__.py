from vigil_worker.trainer.rank import exit_process, main

exit_process(main())
