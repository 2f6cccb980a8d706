//! `verl-core data gen`: the synthetic addition task as verl's parquet files.

use std::process::ExitCode;

use verl_data::synthetic::AdditionTask;

use crate::args::DataCommand;

pub fn run(command: DataCommand) -> anyhow::Result<ExitCode> {
    let DataCommand::Gen {
        output,
        train_size,
        val_size,
        min_digits,
        max_digits,
        operands,
        seed,
        tokenizer,
    } = command;
    let task = AdditionTask {
        min_digits,
        max_digits,
        operands,
        train_size,
        val_size,
        seed,
    };
    let (train, val) = task.write(&output)?;
    println!("{}\n{}", train.display(), val.display());
    if tokenizer {
        verl_data::synthetic::write_tokenizer(&output)?;
        println!("{}", output.join("tokenizer.json").display());
    }
    Ok(ExitCode::SUCCESS)
}
