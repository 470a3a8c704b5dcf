//! Mode decisions and their execution: which mode a device should be in and the program that
//! gets it there ([`policy`], pure), the exact ordered sysfs writes of that program ([`plan`],
//! pure and printable), the decision and plan for one device from the store and a live snapshot
//! ([`planner`]), and the executor that runs a plan with read-back and rollback ([`convert`]).

pub mod convert;
pub mod plan;
pub mod planner;
pub mod policy;
