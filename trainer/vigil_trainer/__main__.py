from vigil_trainer.rank import exit_process, main

exit_process(main())
